"""A stand-in for the part of TensorRT-LLM's Python API that ``inference.engine.runners.tensorrt_llm`` uses.

TensorRT-LLM needs an NVIDIA GPU and several GB of CUDA wheels, so the runner's tests put this
package on ``sys.path`` instead. Names, constructor keywords, output objects and their behaviour
mirror the real source (NVIDIA/TensorRT-LLM on GitHub), read for this purpose:

- ``tensorrt_llm/__init__.py`` (c40f1157): top-level ``LLM`` and ``SamplingParams``.
- ``tensorrt_llm/llmapi/__init__.py`` (5ca85aff): ``LLM``, ``RequestOutput``, ``CompletionOutput``,
  ``GuidedDecodingParams``, ``SamplingParams``, ``KvCacheConfig``, ``RequestError``.
- ``tensorrt_llm/llmapi/llm.py`` (4c05a748): ``BaseLLM.__init__`` (unknown keyword arguments raise
  ``ValueError("LLM got invalid argument: …")``), ``generate_async(inputs, sampling_params, …,
  streaming=…)``, ``_prepare_sampling_params``, ``_check_arguments`` (PyTorch backend: a prompt longer
  than ``max_num_tokens`` without chunked prefill raises ``RequestError``, ``ValueError`` in older
  versions; ``max_seq_len`` is not checked), ``shutdown``,
  ``RequestOutput`` (not constructible directly).
- ``tensorrt_llm/llmapi/llm_args.py``: ``BaseLlmArgs`` field names, ``KvCacheConfig`` (strict model).
- ``tensorrt_llm/llmapi/tokenizer.py`` (89fd9b74): ``TransformersTokenizer`` wrapping a Hugging Face
  tokenizer (``encode``, ``decode``, ``decode_incrementally``, ``apply_chat_template``,
  ``eos_token_id``).
- ``tensorrt_llm/sampling_params.py`` (000a01de, a98a9061): ``SamplingParams`` (``max_tokens`` defaults
  to 32, ``logprobs=True`` becomes 1, ``_validate`` refuses top_p outside [0, 1], a negative top_k or
  temperature with ``ValueError`` at construction; ``_get_stop_reasons_and_words`` lists stop token ids,
  then stop strings, in the order given) and ``GuidedDecodingParams`` (``json``, ``regex``, ``grammar``,
  ``json_object``, ``structural_tag``).
- ``tensorrt_llm/executor/result.py`` (a678b91a): ``CompletionOutput`` (``text``, ``token_ids``,
  ``logprobs``, ``finish_reason`` in stop/length/timeout/cancelled, ``stop_reason``, the ``*_diff``
  properties), ``Logprob``, ``GenerationResult`` (async iteration only when created inside a running
  event loop, ``abort()``, ``finished``, ``prompt_token_ids``, ``cached_tokens`` (updated from every
  response); stop strings found by the
  runtime's token ids (``STOP_WORDS``: the ids are cut, the streamed text is not) or in the
  detokenized text, which is cut at the first stop string of the list found in it, not the earliest,
  and the request aborted).
- ``tensorrt_llm/executor/utils.py`` (015884d6) and ``executor/executor.py`` (ed53795b):
  ``RequestError(RuntimeError)``, raised from the iteration for a per-request failure;
  ``GenerationExecutor.generate_async`` asserts on ``prompt_token_ids[0]`` (an empty prompt is an
  ``IndexError``).

- ``tensorrt_llm/_torch/pyexecutor/grammar_matcher.py`` (0fccc5b9) and
  ``docs/source/features/guided-decoding.md`` (14e6b10f): how each guide reaches xgrammar; the
  structural tag is a JSON string ``{"type": "structural_tag", "format": {"type": "triggered_tags",
  "triggers": [...], "tags": [{"begin", "content": {"type": "json_schema", "json_schema"}, "end"}]}}``,
  handed to ``compile_structural_tag`` as it is (xgrammar 0.1.25 and later, which refuse the older
  ``{"structures": [...], "triggers": [...]}`` form). The stand-in compiles guides with the real
  xgrammar. ``LLGuidanceMatcherFactory.create`` has no structural tag case ("Unsupported guide
  type"), so with ``guided_decoding_backend="llguidance"`` such a guide fails the batch.
  ``json_object=True`` is ``GuideType.JSON``: xgrammar's builtin JSON grammar
  (``compile_builtin_json_grammar``), which admits an array as well as an object.
- ``tensorrt_llm/_torch/pyexecutor/py_executor.py`` (two versions read):
  ``_handle_errors`` fails every active request with one error message, which is what an exception
  in the batch's guided decoder leads to; ``_handle_canceled_requests`` drops cancelled requests
  from the waiting queue (``executor_request_queue.py``, ``update_waiting_queue``) and sends
  ``CANCELLED`` only for active ones.
- ``tensorrt_llm/_torch/pyexecutor/_util.py`` and ``sampler.py`` (versions of 2025, before the
  per-request seeds of 2026): ``sampler_type`` "auto" is the ``TorchSampler`` unless beam search is
  asked for. It samples the whole batch from one generator seeded ``_global_seed = 42`` and never reads
  a request's seed; it adds every sampled token, the end-of-sequence one too, to the request before it
  checks the stop criteria (``update_requests``), so ``token_ids`` ends with the end id on an
  ``END_ID`` stop. ``sampler_type="TRTLLMSampler"`` is the C++ sampler: a request's seed, or 0 without
  one (``sampling_params.py``: "None means using C++ runtime default 0"), and an end token its
  sampling kernels never count in the sequence length ("Do not increase seq len when EOS is generated").
  Its logprobs are the sampled token's alone, as rank 1, however many were asked for
  (``update_requests_single_beam_single_step``).
- ``tensorrt_llm/executor/base_worker.py``: ``_deduce_max_tokens`` clamps ``max_tokens``
  to ``max_seq_len - prompt length`` without refusing anything; ``_enqueue_request`` builds the C++
  ``SamplingConfig``, whose checks (``cpp/tensorrt_llm/executor/samplingConfig.cpp``) refuse
  ``top_p`` outside (0, 1], a negative ``top_k`` or temperature, and become a ``RequestError``.

What is not real lives in ``tensorrt_llm/_toy.py``: a whitespace tokenizer and an in-flight-batching
"engine" that echoes the prompt's words, or writes a minimal instance of a guided JSON schema (or of
a structural tag's first tag), one token per step for every request in flight.
"""

from .llmapi import LLM
from .sampling_params import SamplingParams

# The release the stand-in follows (``tensorrt_llm/version.py``); the runner needs 1.2 or later.
__version__ = "1.2.0"

__all__ = ["LLM", "SamplingParams", "__version__"]
