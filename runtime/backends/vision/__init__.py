"""Vision-language models through mlx-vlm (the ``[vision]`` extra): images (and, for SmolVLM2,
videos) in chat messages.

``media`` decodes and keys images (no MLX), ``video`` samples a video's frames (OpenCV),
``store`` holds each image's span and features,
``model`` wraps an mlx-vlm model for the MLX backend, ``prompt`` puts images into chat prompts,
``load`` reads a VLM directory. See docs/models.md (vision).
"""
