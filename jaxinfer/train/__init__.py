"""Training the embedded default model on CPU with optax: corpus (data.py), tokenizer (tokenizer.py), loss and
step (step.py), FP8 export (export.py), evaluation (evaluate.py), the recipe (recipe.py) and the end-to-end
pipeline (pipeline.py, run by scripts/train_tiny.py)."""
