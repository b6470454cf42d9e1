"""What every room shares: the command-line parser, the I/O contract, model configs, process helpers."""
