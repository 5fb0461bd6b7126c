"""diffusion-runtime."""
