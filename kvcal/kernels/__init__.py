"""The quantized KV runtime: a transformers Cache that stores codes + scales (`cache`), the attention function
registered with transformers (`attention`), the torch reference (`reference`) and the Triton kernels
(`triton_attention`, imported lazily: Triton is optional and absent off Linux). Entry point: `runtime.KVRuntime`."""
