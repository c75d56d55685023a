"""Writing a model out of mcp2026 in other engines' formats: GGUF (llama.cpp) and compressed-tensors
(transformers, vLLM), each tensor as the plan quantized it. The inverse of ``loading``: the same names, row
permutations and query scale, undone in the other direction."""
