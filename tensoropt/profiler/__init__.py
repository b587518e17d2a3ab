"""The profiler: measure the devices and links of this machine and write a device profile."""
