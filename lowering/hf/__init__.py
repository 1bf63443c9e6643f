"""Hugging Face models by directory or hub id, wrapped for a task as ExecuTorch expects them.

:func:`load_hf` loads a model with transformers' Auto classes
(``from_pretrained``: a ``save_pretrained`` directory, or a hub id where the
network allows) and returns the methods of one program plus its constant
(metadata) methods, ready for :func:`lowering.lower`::

    hf = load_hf("./tiny-llama", "text-generation", max_seq_len=128)
    lower(hf.lower_input(), partitioner=XnnpackPartitioner(),
          share_mutable_buffers=hf.share_mutable_buffers)

    task                           Auto class                        methods
    text-generation                AutoModelForCausalLM              forward(input_ids[1,S], cache_position[S]) + get_max_seq_len, ...
    feature-extraction             AutoModel                         forward(input_ids[1,S], attention_mask[1,S])
    fill-mask                      AutoModelForMaskedLM              forward(input_ids[1,S], attention_mask[1,S])
    image-classification           AutoModelForImageClassification   forward(pixel_values[1,C,H,W])
    automatic-speech-recognition   AutoModelForSpeechSeq2Seq         encoder(input_features),
                                                                     text_decoder(ids[1,1], hidden, cache_position[1])

Options: ``max_seq_len`` (KV cache / longest input; default the config's
``max_position_embeddings`` capped at 2048), ``dtype`` (``float32``, ``float16``,
``bfloat16``), ``attn`` (text-generation and automatic-speech-recognition's decoder:
``standard`` aten SDPA or ``custom`` ExecuTorch's ``llama::custom_sdpa`` +
``llama::update_cache``), ``last_token_logits`` (text-generation: ``forward`` returns
only the last position's logits, as ExecuTorch's own LLM export does by default; the
runner reads only that row).  ``transformers``
is the product extra ``hf``; without it every entry point fails with one line
naming the model and ``pip install 'lowerflow[hf]'``.

The rooms: :mod:`~lowering.hf.loading` (transformers, directories, dtype),
:mod:`~lowering.hf.text_generation`, :mod:`~lowering.hf.encoders`,
:mod:`~lowering.hf.speech` (the tasks' wrappers), :mod:`~lowering.hf.metadata`
(the constant methods).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from . import metadata
from .loading import (
    DTYPES,
    INSTALL_HINT,
    HFError,
    check_source,
    from_pretrained,
    model_directory,
    require_transformers,
    torch_dtype,
    transformers_version,
)

#: task -> the transformers Auto class that loads it.
TASKS = {
    "text-generation": "AutoModelForCausalLM",
    "feature-extraction": "AutoModel",
    "fill-mask": "AutoModelForMaskedLM",
    "image-classification": "AutoModelForImageClassification",
    "automatic-speech-recognition": "AutoModelForSpeechSeq2Seq",
}

#: The options of an hf: model (besides its task).
OPTIONS = ("max_seq_len", "dtype", "attn", "last_token_logits")

#: The tasks whose decoder has a KV cache, and so an ``attn`` option.
ATTN_TASKS = ("text-generation", "automatic-speech-recognition")

#: Longest default max_seq_len (the config's max_position_embeddings when smaller).
DEFAULT_MAX_SEQ_LEN = 2048


@dataclasses.dataclass
class HFProgram:
    """An hf: model wrapped for its task: the methods of one program and its constant methods."""

    source: str
    directory: Path
    task: str
    #: ``{method name: (module, example_inputs, dynamic_shapes or None)}``, in name order.
    methods: dict[str, tuple[torch.nn.Module, tuple, Any]]
    #: ``{method name: value}``: metadata methods (no inputs, a constant result).
    constants: dict[str, Any]
    #: The options as resolved (defaults filled in): part of the model's fingerprint.
    options: dict[str, Any]
    #: The methods share their mutable buffers (pass it to ``lower``): automatic-speech-recognition
    #: with attn custom, whose encoder writes the cross-attention cache text_decoder reads.
    share_mutable_buffers: bool = False

    def lower_input(self) -> dict[str, Any]:
        """What :func:`lowering.lower` takes: the methods and the constant methods in one dict."""
        return {**self.methods, **self.constants}


def check_options(source: str, task: str | None, options: dict[str, Any] | None = None) -> None:
    """HFError naming the model unless ``task`` and ``options`` are valid (no loading)."""
    options = options or {}
    if task not in TASKS:
        raise HFError(f"hf:{source}: task {task!r} is not one of {sorted(TASKS)} (give --task / 'task:')")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise HFError(f"hf:{source}: unknown options {unknown}; allowed: {list(OPTIONS)}")
    value = options.get("max_seq_len")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 2):
        raise HFError(f"hf:{source}: max_seq_len must be an integer >= 2, got {value!r}")
    if options.get("dtype") is not None and options["dtype"] not in DTYPES:
        raise HFError(f"hf:{source}: dtype {options['dtype']!r} is not one of {sorted(DTYPES)}")
    from .text_generation import ATTN

    if options.get("attn") is not None:
        if options["attn"] not in ATTN:
            raise HFError(f"hf:{source}: attn {options['attn']!r} is not one of {list(ATTN)}")
        if task not in ATTN_TASKS:
            raise HFError(f"hf:{source}: attn is an option of {' and '.join(ATTN_TASKS)}, not {task}")
    last = options.get("last_token_logits")
    if last is not None:
        if not isinstance(last, bool):
            raise HFError(f"hf:{source}: last_token_logits must be true or false, got {last!r}")
        if last and task != "text-generation":
            raise HFError(f"hf:{source}: last_token_logits is an option of text-generation, not {task}")


def load_hf(source: str, task: str | None, *, max_seq_len: int | None = None, dtype: str | None = None,
            attn: str | None = None, last_token_logits: bool | None = None,
            trust_pickle: bool = False) -> HFProgram:
    """Load ``source`` (a directory or hub id) for ``task``; see the module docstring.
    ``trust_pickle``: a ``pytorch_model.bin`` may unpickle more than tensors
    (:func:`~lowering.hf.loading.from_pretrained`)."""
    check_options(source, task, {"max_seq_len": max_seq_len, "dtype": dtype, "attn": attn,
                                 "last_token_logits": last_token_logits})
    require_transformers(source)
    check_source(source)
    directory = model_directory(source)
    dtype_ = torch_dtype(source, dtype)
    model = from_pretrained(source, directory, TASKS[task], dtype_, trust_pickle=trust_pickle)
    max_seq_len = max_seq_len or _default_max_seq_len(model)
    options = {"task": task, "max_seq_len": max_seq_len, "dtype": str(dtype_).removeprefix("torch.")}
    with torch.no_grad():
        if task == "text-generation":
            from .text_generation import decoder, default_attn

            attn = attn or default_attn()
            options["attn"] = attn
            if last_token_logits:  # in the options (and fingerprint) only when set
                options["last_token_logits"] = True
            methods = {"forward": decoder(source, model, max_seq_len=max_seq_len, attn=attn,
                                          last_token_logits=bool(last_token_logits))}
            constants = metadata.text_generation(model, max_seq_len=max_seq_len, attn=attn, dtype=dtype_)
        elif task in ("feature-extraction", "fill-mask"):
            from .encoders import text_encoder

            field = "last_hidden_state" if task == "feature-extraction" else "logits"
            methods = {"forward": text_encoder(model, field, max_seq_len)}
            constants = metadata.encoder(model, max_seq_len=max_seq_len)
        elif task == "image-classification":
            from .encoders import image_classifier

            methods = {"forward": image_classifier(model)}
            constants = {}
        else:
            from .speech import frames, speech_methods
            from .text_generation import default_attn

            attn = attn or default_attn()
            options["attn"] = attn
            methods = speech_methods(source, model, max_seq_len, attn=attn)
            constants = metadata.speech_seq2seq(model, max_seq_len=max_seq_len, frames=frames(source, model.config),
                                                attn=attn, dtype=dtype_)
    # automatic-speech-recognition: the encoder writes the cross-attention cache text_decoder reads
    share = task == "automatic-speech-recognition" and options.get("attn") == "custom"
    return HFProgram(source, directory, task, dict(sorted(methods.items())), constants, options, share)


def _default_max_seq_len(model: Any) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "max_target_positions", None)
    return min(int(positions), DEFAULT_MAX_SEQ_LEN) if positions else DEFAULT_MAX_SEQ_LEN


__all__ = ["DTYPES", "HFError", "HFProgram", "INSTALL_HINT", "OPTIONS", "TASKS", "check_options", "load_hf",
           "transformers_version"]
