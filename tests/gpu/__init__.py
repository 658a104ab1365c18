"""Tests that need a CUDA device: run only on a lent GPU machine by ``make gpu-check``."""
