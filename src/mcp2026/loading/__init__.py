"""Loading models: HF folders and GGUF files into our modules, configs and tokenizer."""
