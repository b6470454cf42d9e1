"""Triton Python-backend models (TritonPythonModel) copied into generated repositories."""
