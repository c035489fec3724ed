"""Training: the loop (trainer.py) and the pieces it drives (losses, optim, strategy, timing, checkpoint)."""
