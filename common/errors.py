"""Named exceptions of the engine. Every message says what was wrong and how to fix it."""


class PdserveError(Exception):
    """Base of all pdserve errors."""


class ModelLoadError(PdserveError, ValueError):
    """A model file or directory cannot be loaded (unknown architecture, missing or
    mis-shaped tensor, unsupported quantization). The message names the tensor or key."""


class InvalidRequestError(PdserveError, ValueError):
    """A request's prompt or sampling parameters are invalid. `param` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code  # OpenAI's error code, where it has one (context_length_exceeded)


class DraftModelError(PdserveError, ValueError):
    """The speculative draft model cannot propose for the target: another tokenizer or
    vocabulary, or no file to load it from. The message says which."""


class KVTransferError(PdserveError):
    """Imported KV blocks do not match the request (count, layout, checksum)."""
