"""Offline, one thread per torch process (the pods of the local cluster inherit this environment). The
repository root is on the path through pyproject.toml's pytest pythonpath, so `e2e.*` imports."""
import os

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TRANSFORMERS_OFFLINE', '1')
os.environ.setdefault('OMP_NUM_THREADS', '1')
