"""Starting engine processes: patched SGLang (`sglang`), the simulator (`sim`) and the built-in
tiny model they serve (`tiny_model`). Imports no sglang: the engines run in child processes."""
