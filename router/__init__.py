"""The OpenAI-compatible front door; plans each request's path through E/P/D.

Never import torch at module import time anywhere under this package."""
