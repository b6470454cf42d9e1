"""Export torchvision classifiers into a Triton model repository and serve it."""
