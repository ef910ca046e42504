"""The tokenizer's side of the engine: prompts tokenized, new tokens detokenized (stop strings,
logprobs) into RequestOutputs. Any Hugging Face tokenizer; never torch or transformers."""
