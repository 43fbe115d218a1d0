"""Models, split by role (import the module you need; nothing is re-exported here):

- `geometry`: KV geometry from a config (`KVSpec`, `kv_spec`, `parse_skip_layers`) — pure
- `config`: a model's transformers config (`load_config`), the remote-code check
- `resolve`: MODEL -> a local folder with safetensors weights (`resolve_model`)
- `gguf`: the cached safetensors conversion of a .gguf file
- `real`: the two real models kvcal installs by name (`smollm2`, `gemma3-270m`)
- `loading`: model + tokenizer for inference (`load_model`, `resolve_dtype`, `check_device`, `input_device`)

kvcal's cache folder and content hashes live below every layer, in `kvcal.filecache`.
"""
