"""The one exception type of the checkpoint layer."""


class CheckpointError(ValueError):
    """A checkpoint (file, index, tensor or orbax directory) is missing, malformed or inconsistent.

    Messages name the file or tensor and the numbers involved, e.g.
    ``"model-00002-of-00003.safetensors is truncated: data needs 4096 bytes, file has 1024"``.
    Subclasses ValueError so callers that validate user input can catch one type.
    """
