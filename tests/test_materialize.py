"""Models built on the meta device, in one process: what ``meta_init`` builds, how ``Materializer`` fills a
model (the same values as by hand), and the errors for what nothing initialises."""

import pytest
import torch
from torch import nn

import tensoropt
from tensoropt.errors import TensorOptError
from tensoropt.models.transformer import DecoderLM, TransformerConfig, init_weights
from tensoropt.runtime.materialize import Materializer

CPU = torch.device("cpu")
CFG = TransformerConfig(hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=64, seq_length=8,
                        vocab_size=64)
ROPE = TransformerConfig(hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=64, seq_length=8,
                         vocab_size=64, position="rope", norm="rmsnorm", activation="swiglu", num_key_value_heads=2)


def by_hand(cfg: TransformerConfig) -> DecoderLM:
    """A meta-built model materialised the documented way, written out: to_empty, re-tie, then every
    module's reset_parameters() and init_weights in model.modules() order."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = DecoderLM(cfg)
    model.to_empty(device=CPU)
    if cfg.tie_embeddings:
        model.head.weight = model.embed.weight          # to_empty gives each name its own tensor
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
            init_weights(module)
    return model


def materialised(cfg: TransformerConfig, build=tensoropt.meta_init) -> DecoderLM:
    torch.manual_seed(0)
    with build():
        model = DecoderLM(cfg)
    Materializer(model, init_weights).materialize(model, CPU)
    return model


def test_meta_init_puts_parameters_on_meta_and_computes_buffers():
    with tensoropt.meta_init():
        model = DecoderLM(ROPE)
    assert all(p.is_meta for p in model.parameters())
    real = DecoderLM(ROPE)
    for name, buffer in model.named_buffers():
        assert not buffer.is_meta
        torch.testing.assert_close(buffer, dict(real.named_buffers())[name], rtol=0, atol=0)
    assert nn.Linear(2, 2).weight.device == CPU                  # construction is back to normal afterwards


@pytest.mark.parametrize("cfg", [CFG, ROPE], ids=["gpt-tied", "llama-rope"])
@pytest.mark.parametrize("build", [tensoropt.meta_init, lambda: torch.device("meta")], ids=["meta_init", "meta"])
def test_materialised_equals_by_hand(cfg, build):
    model, expected = materialised(cfg, build), by_hand(cfg)
    got, want = model.state_dict(), expected.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    for name, buffer in model.named_buffers():                    # masks and rotary tables, even built on meta
        torch.testing.assert_close(buffer, dict(DecoderLM(cfg).named_buffers())[name], rtol=0, atol=0)
    if cfg.tie_embeddings:
        assert model.head.weight is model.embed.weight             # still one parameter


def test_parallelize_alone_materialises_and_trains_like_the_model_built_by_hand():
    with tensoropt.meta_init():
        torch.manual_seed(0)
        meta = DecoderLM(CFG)
    tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    model, _, run = tensoropt.parallelize(meta, lambda p: torch.optim.SGD(p, lr=0.1), example_inputs=batch,
                                          global_batch=4, init_fn=init_weights)
    reference = by_hand(CFG)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    assert next(model.parameters()).device == CPU
    for _ in range(2):
        optimizer.zero_grad()
        expected = reference(*batch)
        expected.backward()
        optimizer.step()
        assert run.train_step(batch) == pytest.approx(float(expected.detach()), rel=1e-6)


class Custom(nn.Module):
    """A parameter made by hand (no reset_parameters) and a buffer."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3))
        self.register_buffer("scale", torch.full((3,), 2.0))
        self.lin = nn.Linear(3, 3)


def _materialise(model, init_fn=None):
    Materializer(model, init_fn).materialize(model, CPU)


def test_what_nothing_initialises_is_named():
    with tensoropt.meta_init():
        model = Custom()
    with pytest.raises(TensorOptError, match=r"^w came from the meta device and nothing initialised them"):
        _materialise(model)                                       # the Linear resets itself; `w` has nothing
    with torch.device("meta"):
        model = Custom()
    with pytest.raises(TensorOptError, match=r"^w, scale came from .*tensoropt.meta_init\(\)"):
        _materialise(model)


def test_init_fn_initialises_what_the_modules_do_not():
    def init(module):
        if isinstance(module, Custom):
            nn.init.ones_(module.w)
            module.scale.fill_(3.0)
    with torch.device("meta"):
        model = Custom()
    _materialise(model, init)
    assert torch.equal(model.w, torch.ones(3, 3)) and torch.equal(model.scale, torch.full((3,), 3.0))
    assert not model.lin.weight.is_meta and model.w.device == CPU
