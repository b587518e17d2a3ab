"""Built-in presets match their published parameter counts; GPT FLOPs match the standard formula."""

import pytest
import torch

import tensoropt
from tensoropt.models import PRESETS, resolve_model

SLOW_CAPTURES = {"gpt3-175b", "megatron-1t", "gpt3-13b", "gpt3-6.7b"}


def _parameters(name: str) -> int:
    model, _ = resolve_model(name).build(None, None)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameter_count_matches_published(name):
    preset = PRESETS[name]
    ours, published = _parameters(name), preset.published_parameters
    if preset.rounded:
        # published to two significant figures (GPT-3 Table 2.1): ours must round to it
        assert round(ours, -int(f"{published:e}".split("e")[1]) + 1) == published
    else:
        assert abs(ours / published - 1) <= 0.01, f"{name}: {ours:,} vs {published:,.0f}"


@pytest.mark.parametrize("name", [n for n, p in PRESETS.items() if p.family == "gpt"])
def test_gpt_parameters_equal_megatron_closed_form(name):
    """P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12lh)) + 2h (Narayanan et al., SC'21, sec. 5.1; the
    final LayerNorm's 2h added), exact for the Megatron layout."""
    c = PRESETS[name].config
    layers, h, vocab, s = c.num_layers, c.hidden_size, c.vocab_size, c.seq_length
    assert _parameters(name) == 12 * layers * h * h + 13 * layers * h + (vocab + s) * h + 2 * h


def _flops_case(name):
    return pytest.param(name, marks=pytest.mark.slow) if name in SLOW_CAPTURES else name


@pytest.mark.parametrize("name", [_flops_case(n) for n, p in PRESETS.items() if p.family == "gpt"])
def test_gpt_flops_per_iteration_match_6PT_plus_attention(name):
    """FLOPs per iteration = 6 P T + 12 l s h T for T tokens (Kaplan et al. 2020, sec. 2.1;
    Narayanan et al. SC'21, appendix: 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) without recomputation)."""
    c = PRESETS[name].config
    graph = tensoropt.capture(name).graph
    tokens = c.seq_length                       # batch size 1
    expected = 6 * graph.num_parameters * tokens + 12 * c.num_layers * c.seq_length * c.hidden_size * tokens
    assert abs(graph.flops_per_iteration / expected - 1) <= 0.05


def test_flops_scale_with_batch_size():
    one = tensoropt.capture("gpt2-small", batch_size=1).graph.flops_per_iteration
    four = tensoropt.capture("gpt2-small", batch_size=4).graph.flops_per_iteration
    assert four == 4 * one


def test_presets_are_captured_in_bf16():
    graph = tensoropt.capture("gpt2-small").graph
    assert {m.dtype for _, m in graph.params} == {"bfloat16"}
    assert torch.bfloat16.itemsize * graph.num_parameters == graph.parameter_bytes
