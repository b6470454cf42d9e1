"""tritonclient scripts: classify images, benchmark and tune the batching config."""
