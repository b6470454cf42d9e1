"""What a user runs against a served model: classify images, the demo, a curl example."""
