"""zfunc's examples: a small GPT (`gpt`), its corpus (`data`) and its training script (`train_gpt`)."""
