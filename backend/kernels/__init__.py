"""GPU kernels of the patched engine (Triton). kv_copy: gather/scatter of scattered KV slots
across every layer (BROS checkpoint kernels)."""
