"""mlx-actor-runtime: an actor-model LLM inference runtime on MLX.

What a host uses is importable from here: ``from runtime import Runtime, RuntimeConfig, ModelSpec``
(docs/api.md, "Imports"). The names load on first use (PEP 562): ``runtime.host.api`` imports the
actors, which import ``runtime`` modules, so an eager import here would make ``import actors.x``
circular, and a host that imports one message module should not pay for the whole runtime.
Nothing here imports MLX; a model load does, and only for the MLX backend. Importing the package
loads OpenBLAS for MLX where the machine has it (runtime/blas.py): before anything imports MLX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from runtime.blas import use_fast_blas

use_fast_blas()

if TYPE_CHECKING:
    from runtime.backends.model_source import PreparedModel, default_model_spec, prepare_model
    from runtime.cluster.options import ClusterConfig
    from runtime.errors import (
        ActorStopped,
        BackendError,
        ContextLengthExceeded,
        DuplicateRequestId,
        EngineCrashed,
        InvalidConfig,
        InvalidModelSpec,
        InvalidRequest,
        KVBudgetExhausted,
        KVRequestTooLarge,
        MalformedMessage,
        MlxRuntimeError,
        ModelAlreadyLoaded,
        ModelFailed,
        ModelFetchFailed,
        ModelLoadFailed,
        ModelNotLoaded,
        ModelRestarting,
        ModelUnloading,
        RequestTimedOut,
        RuntimeClosed,
        StepTimedOut,
        StreamStalled,
        SupervisionEscalated,
        UnsupportedCache,
        UnsupportedModelFormat,
        error_for_code,
    )
    from runtime.host.api import Runtime, RuntimeStats
    from runtime.host.config import RuntimeConfig
    from runtime.host.streams import Completion, GenerationStream
    from runtime.kernel.supervision import RestartPolicy
    from runtime.messages import (
        IMAGE_PLACEHOLDER,
        Cancelled,
        ChatMessage,
        ChatOptions,
        Failed,
        Finished,
        FinishReason,
        HostEvent,
        ImagePart,
        ModelLoaded,
        ModelSpec,
        ModelUnloaded,
        PrefixesReset,
        Rejected,
        Request,
        ReusePath,
        Sampling,
        SessionEnded,
        Started,
        Stats,
        TokenLogprob,
        TokensEmitted,
        Tool,
        ToolCall,
        Usage,
    )
    from runtime.progress import Progress, tqdm_progress
    from runtime.text.coalesce import CoalescePolicy

__all__ = [
    # the runtime and its configuration
    "Runtime",
    "RuntimeConfig",
    "RestartPolicy",
    "CoalescePolicy",
    "ClusterConfig",
    "GenerationStream",
    "Completion",
    "RuntimeStats",
    "Stats",
    # what to load
    "ModelSpec",
    "default_model_spec",
    "prepare_model",
    "PreparedModel",
    "Progress",
    "tqdm_progress",
    # what to ask
    "Request",
    "Sampling",
    "ChatMessage",
    "ChatOptions",
    "ImagePart",
    "IMAGE_PLACEHOLDER",
    "Tool",
    "ToolCall",
    # what comes back
    "HostEvent",
    "Started",
    "TokensEmitted",
    "Finished",
    "Cancelled",
    "Failed",
    "Rejected",
    "FinishReason",
    "ReusePath",
    "Usage",
    "TokenLogprob",
    "ModelLoaded",
    "ModelUnloaded",
    "PrefixesReset",
    "SessionEnded",
    # errors
    "MlxRuntimeError",
    "InvalidRequest",
    "ContextLengthExceeded",
    "MalformedMessage",
    "InvalidModelSpec",
    "InvalidConfig",
    "ModelNotLoaded",
    "ModelAlreadyLoaded",
    "DuplicateRequestId",
    "ModelLoadFailed",
    "ModelFetchFailed",
    "UnsupportedModelFormat",
    "UnsupportedCache",
    "KVBudgetExhausted",
    "KVRequestTooLarge",
    "BackendError",
    "EngineCrashed",
    "StepTimedOut",
    "ModelRestarting",
    "ModelFailed",
    "ModelUnloading",
    "RequestTimedOut",
    "StreamStalled",
    "ActorStopped",
    "RuntimeClosed",
    "SupervisionEscalated",
    "error_for_code",
]

# Where each exported name lives; tests/test_imports.py checks this matches ``__all__``.
_HOMES: dict[str, tuple[str, ...]] = {
    "runtime.host.api": ("Runtime", "RuntimeStats"),
    "runtime.host.streams": ("GenerationStream", "Completion"),
    "runtime.host.config": ("RuntimeConfig",),
    "runtime.cluster.options": ("ClusterConfig",),
    "runtime.kernel.supervision": ("RestartPolicy",),
    "runtime.text.coalesce": ("CoalescePolicy",),
    "runtime.backends.model_source": ("default_model_spec", "prepare_model", "PreparedModel"),
    "runtime.progress": ("Progress", "tqdm_progress"),
    "runtime.messages": (
        "Stats",
        "ModelSpec",
        "Request",
        "Sampling",
        "ChatMessage",
        "ChatOptions",
        "ImagePart",
        "IMAGE_PLACEHOLDER",
        "Tool",
        "ToolCall",
        "HostEvent",
        "Started",
        "TokensEmitted",
        "Finished",
        "Cancelled",
        "Failed",
        "Rejected",
        "FinishReason",
        "ReusePath",
        "Usage",
        "TokenLogprob",
        "ModelLoaded",
        "ModelUnloaded",
        "PrefixesReset",
        "SessionEnded",
    ),
    "runtime.errors": (
        "MlxRuntimeError",
        "InvalidRequest",
        "ContextLengthExceeded",
        "MalformedMessage",
        "InvalidModelSpec",
        "InvalidConfig",
        "ModelNotLoaded",
        "ModelAlreadyLoaded",
        "DuplicateRequestId",
        "ModelLoadFailed",
        "ModelFetchFailed",
        "UnsupportedModelFormat",
        "UnsupportedCache",
        "KVBudgetExhausted",
        "KVRequestTooLarge",
        "BackendError",
        "EngineCrashed",
        "StepTimedOut",
        "ModelRestarting",
        "ModelFailed",
        "ModelUnloading",
        "RequestTimedOut",
        "StreamStalled",
        "ActorStopped",
        "RuntimeClosed",
        "SupervisionEscalated",
        "error_for_code",
    ),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> object:
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
