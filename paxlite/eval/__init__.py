"""Zero-shot evaluation tasks (Lambada acc_strict) over a trained language model."""
