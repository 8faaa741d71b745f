"""LLMEngine: the step loop that prefill and decode workers both drive.

add_request() validates and queues; step() schedules, runs the model once, samples, applies
stop conditions and returns what each request produced. Finished and aborted requests free
their blocks immediately (unless the caller asked to hold them for a KV export).
A request may run under a LoRA adapter (`add_request(..., lora=name)`, adapters loaded by
`load_lora` or `EngineConfig.lora.modules`; engine/core/lora_registry.py, docs/lora.md).
"""
from __future__ import annotations

import itertools
import time
import random
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pdserve.engine.kernels.attention import NativeAttentionBackend, default_backend
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.kv_hooks import KVTransferHooks
from pdserve.engine.core.lora_registry import LoRAInfo, LoRARegistry
from pdserve.engine.config import EngineConfig
from pdserve.common.detokenizer import IncrementalDetokenizer
from pdserve.engine.sampling.draft import DraftSpeculator, load_draft
from pdserve.common.block_hash import root_hash
from pdserve.common.errors import InvalidRequestError
from pdserve.common.kv_events import EventListener
from pdserve.common.outputs import EngineStats, RequestOutput, TokenLogprobs
from pdserve.engine.kv.cache import KVCache, engine_kv_format
from pdserve.engine.core.request import Request, RequestStatus
from pdserve.engine.core.micro_batches import MicroBatches
from pdserve.engine.core.runner import ModelRunner
from pdserve.engine.sampling.sampler import draw, sample
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.sampling.grammar import disallowed_rows, grammar_state
from pdserve.engine.sampling.speculative import NgramSpeculator
from pdserve.engine.kv.tiers import kv_tiers, tier_stats
from pdserve.common.tokenizer import Tokenizer
from pdserve.common.tokens import check_token_ids
from pdserve.engine.model.weights import LoadedModel, load_for_config

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLMEngine(KVTransferHooks):
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None,
                 tokenizer: Tokenizer | None = None, event_listener: EventListener | None = None,
                 draft: LoadedModel | None = None, tp=None):
        """`draft`: the speculative draft model, if loaded already (else the config's
        `speculative_model` is loaded here). `tp`: the tensor-parallel group
        (engine/tp.TensorParallel) whose rank 0 this engine is; `loaded` is its slice."""
        self.config = config = config or EngineConfig()
        if tp is not None:  # rank 0 runs as many threads as each of the other ranks
            torch.set_num_threads(tp.threads)
        elif config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.loaded = loaded
        self.model_config = loaded.config
        self.tokenizer = tokenizer
        self.tp = tp
        self.kv_cache = tp.kv_cache() if tp is not None else KVCache(
            loaded.config, config.cache, engine_kv_format(config, loaded.model), config.device)
        self.blocks = BlockManager(self.kv_cache.num_blocks, config.cache.block_size,
                                   config.cache.enable_prefix_caching, config.cache.cache_namespace,
                                   event_listener)
        if tp is None:  # a tensor-parallel group's ranks each hold a slice of every block
            self.blocks.tiers = kv_tiers(config.cache, self.kv_cache.kv)
        self.scheduler = Scheduler(config.scheduler, self.blocks)
        # Triton kernels on CUDA, the C kernel on CPU (the model is shared between engines;
        # backends keep no state beyond the step's metadata)
        self._attach_kernels(loaded)
        self.runner = ModelRunner(loaded.model, self.kv_cache, self.blocks, tp)
        # a request can never need more blocks than the cache holds (it would preempt itself forever)
        self.max_model_len = min(loaded.config.max_position_embeddings,
                                 self.kv_cache.num_blocks * config.cache.block_size)
        self.speculator = self._speculator(draft)
        self.loras = LoRARegistry(config.lora, loaded.model, loaded.config, _DTYPES[config.dtype], config.device)
        for name, path in config.lora.modules:
            self.loras.load(name, path)
        self.eos_token_id = tokenizer.eos_token_id if tokenizer else loaded.config.eos_token_id
        self._rng = random.Random(config.seed)  # seeds for requests that give none
        self._ids = itertools.count()
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._mask_pool: ThreadPoolExecutor | None = None  # grammar masks beside the forward pass
        self._held: dict[str, Request] = {}   # finished, blocks kept for export
        self.last_step_progress = False
        self._hold: set[str] = set()
        self._layer_streams: dict[str, tuple] = {}  # request id -> (on_layers, group, first_block)
        self.micro_batches = MicroBatches.of(self)  # a pipeline's micro-batches in flight; None: one step at a time

    def _attach_kernels(self, loaded: LoadedModel) -> None:
        config = self.config
        loaded.model.backend = default_backend(config.device, _DTYPES[config.dtype], config.attention)
        # with the C attention kernel come the fused C elementwise ops (RoPE, SwiGLU); "torch": none
        fused = getattr(loaded.model.model.layers[0].mlp, "gate_up_weight", None) is not None
        loaded.model.use_native_ops(isinstance(loaded.model.backend, NativeAttentionBackend) and fused)

    def _speculates(self, sched) -> bool:
        """Whether this step checks guesses: a speculator runs and the step decodes at most
        `speculative_max_batch` requests (beyond that the extra rows cost more than they save)."""
        limit = self.config.speculative_max_batch
        return self.speculator is not None and (
            not limit or sum(1 for c in sched.chunks if c.num_new_tokens == 1) <= limit)

    def _speculator(self, draft: LoadedModel | None):
        config = self.config
        budget = config.scheduler.max_num_batched_tokens
        if not config.speculative_tokens:
            return None
        if draft is None and not config.speculative_model:
            return NgramSpeculator(config.speculative_tokens, self.blocks, self.max_model_len, budget)
        if self.tp is not None:
            raise ValueError("a draft model with tensor, expert or pipeline parallelism is not supported yet: use "
                             "prompt lookup (--speculative-tokens without --speculative-model) or degree 1")
        draft = draft or load_draft(config, self.loaded, self.tokenizer)
        self._attach_kernels(draft)
        return DraftSpeculator(config.speculative_tokens, draft, self.blocks, self.kv_cache, config.cache,
                               config.device, self.max_model_len, budget)

    @classmethod
    def tensor_parallel(cls, source, config: EngineConfig, tp: int, tokenizer: Tokenizer | None = None,
                        event_listener: EventListener | None = None, **kw) -> "LLMEngine":
        """An engine over `tp` ranks (engine/parallel/tp.py) reading the model from `source` (a
        tp.ModelSource); `shutdown()` stops the other ranks."""
        from pdserve.engine.parallel.tp import TensorParallel
        group = TensorParallel(source, config, tp, **kw)
        try:
            return cls(group.loaded, config, tokenizer, event_listener, tp=group)
        except BaseException:
            group.stop()
            raise

    def shutdown(self) -> None:
        """Stop the tensor-parallel group's other ranks and the grammar-mask thread."""
        if self._mask_pool is not None:
            self._mask_pool.shutdown(wait=False)
            self._mask_pool = None
        if self.micro_batches is not None:
            self.micro_batches.close()
        if self.tp is not None:
            self.tp.stop()
        if self.blocks.tiers is not None:
            self.blocks.tiers.close()

    @classmethod
    def from_config(cls, config: EngineConfig, event_listener: EventListener | None = None) -> "LLMEngine":
        """Load the configured model (default: SmolLM2-135M-Instruct) and its tokenizer."""
        loaded = load_for_config(config)
        return cls(loaded, config, Tokenizer.from_model_path(loaded.path), event_listener)

    # ---- requests -----------------------------------------------------------------------
    def _make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                      lora: str | None = None, grammar: bool = True) -> Request:
        """The request, checked; `grammar` False: its structured-output grammar is left to
        `_grammar` (compiling one costs ~0.3 ms, wasted on a KV hand-off refused for blocks)."""
        if request_id in self.scheduler.requests or request_id in self._held:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        params.validate(self.model_config.vocab_size)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer: pass token ids", param="prompt")
            prompt = self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty: give at least one token", param="prompt")
        check_token_ids(ids, self.model_config.vocab_size, "prompt")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; this model's context length is {self.max_model_len} "
                f"tokens, which leaves no room to generate: shorten the prompt", param="prompt",
                code="context_length_exceeded")
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context length "
                f"of {self.max_model_len} tokens: lower max_tokens to at most {room}", param="max_tokens",
                code="context_length_exceeded")
        gen = torch.Generator()
        gen.manual_seed(params.seed if params.seed is not None else self._rng.randrange(2**63))
        compiled = self._grammar(params) if grammar else None
        detokenize = self.tokenizer is not None and self.config.detokenize
        if params.stop and not detokenize:
            raise InvalidRequestError("stop strings need an engine that detokenizes; use stop_token_ids", param="stop")
        # the adapter last: nothing after it raises, so a refused request holds none
        adapter = self.loras.acquire(lora) if lora is not None else None
        req = Request(request_id, ids, params, max_tokens, self.eos_token_id, generator=gen, lora=adapter)
        req.grammar = compiled
        if detokenize:
            self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop, min_tokens=params.min_tokens)
        return req

    def _grammar(self, params: SamplingParams):
        """The grammar state of a structured-output request (None without one)."""
        if params.structured is None:
            return None
        if self.tokenizer is None:
            raise InvalidRequestError("structured output needs the model's tokenizer", param="response_format")
        return grammar_state(self.tokenizer.grammar_compiler(self.model_config.vocab_size), params.structured)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    hold_kv: bool = False, resume: list[int] | None = None, lora: str | None = None) -> None:
        """Queue a request. With `hold_kv`, its blocks outlive it until `release_kv` (the
        prefill worker exports them after the first token). `resume`: tokens this request
        already produced elsewhere (a migration): they count against max_tokens and for
        penalties, and a seeded request continues its random stream after them, so the
        rest equals an uninterrupted run. `lora`: the name of a loaded LoRA adapter to run
        it under (`load_lora`; None: the base model): LoRANotFoundError if unknown,
        LoRACapacityError if every resident adapter is busy and this one is not resident."""
        req = self._make_request(request_id, prompt, params or SamplingParams(), lora)
        if resume:
            try:
                self._resume(req, list(resume))
            except InvalidRequestError:
                self._detok.pop(request_id, None)
                if req.lora is not None:
                    self.loras.release(req.lora)
                raise
        if hold_kv:
            self._hold.add(request_id)
        self.scheduler.add(req)

    def _resume(self, req: Request, tokens: list[int]) -> None:
        check_token_ids(tokens, self.model_config.vocab_size, "resume")
        if len(tokens) >= req.max_tokens:
            raise InvalidRequestError(f"{len(tokens)} tokens already generated: nothing left of "
                                      f"max_tokens={req.max_tokens}", param="resume")
        for t in tokens:
            if req.grammar is not None and not req.grammar.consume(t):
                raise InvalidRequestError("resume tokens do not follow the request's constraint", param="resume")
            req.append_output(t)
            if not req.params.greedy:  # one draw per sampled token, as the sampler makes
                draw(req)

    def load_lora(self, name: str, path: str) -> LoRAInfo:
        """Load (or replace, when idle) the PEFT adapter in directory `path` as `name`; see
        engine/core/lora_registry.py for the errors."""
        self.loras.load(name, path)
        return next(i for i in self.loras.adapters() if i.name == name)

    def unload_lora(self, name: str) -> None:
        """Forget adapter `name` (LoRAInUseError while requests use it)."""
        self.loras.unload(name)

    def cache_root(self, cache_salt: str = "", lora: str | None = None) -> int:
        """The root of the block hashes of a request with this salt and adapter name here
        (what a worker or a KV peer looks a prompt's cached blocks up under)."""
        return root_hash(cache_salt, self.loras.identity(lora) if lora is not None else "")

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks now. False if unknown."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return self.release_kv(request_id)
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return True

    def abort_all(self) -> None:
        """Abort every request, and free the blocks held for a KV export (engine shutdown)."""
        for rid in list(self.scheduler.requests) + list(self._held):
            self.abort(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self.micro_batches and self.micro_batches.stash)

    def most_urgent_priority(self) -> int | None:
        """The most urgent priority this engine has work for (None: none needs compute)."""
        return self.scheduler.most_urgent()

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.micro_batches is not None:
            return self.micro_batches.step()
        sched = self.scheduler.schedule()
        # False: nothing ran and nothing changed (all waiting on remote KV or on memory), so
        # stepping again before the next add/abort/import would only spin
        self.last_step_progress = sched.num_tokens > 0 or bool(sched.preempted)
        return self._run(sched)

    def _run(self, sched) -> list[RequestOutput]:
        """Run a scheduled step through the model in one pass and sample it."""
        if not sched.chunks:
            return []
        t0 = time.perf_counter()
        guesses = self.speculator.extend(sched, self._hold) if self._speculates(sched) else {}
        masks = None if guesses else self._start_masks(sched.chunks)
        if (ran := self._execute(sched, guesses, masks)) is None:
            return []
        completed, logits = ran
        for c in sched.chunks:
            if c.request.request_id not in guesses:  # a speculative chunk's progress is settled below
                c.request.num_computed_tokens += c.num_new_tokens
        if not guesses:
            reqs = [c.request for c in completed]
            tokens, logprobs = sample(logits, reqs, masks.result() if masks else None) if reqs else ([], [])
            self.scheduler.observe_step(time.perf_counter() - t0, sched)
            return [self._on_token(r, t, lp) for r, t, lp in zip(reqs, tokens, logprobs)]
        outputs = self._finish_speculative_step(completed, logits, guesses)
        self.scheduler.observe_step(time.perf_counter() - t0, sched)
        return outputs

    def _start_masks(self, chunks) -> Future | None:
        """The grammar masks of the requests this step samples for, computed on a thread of
        their own while the forward pass runs (llguidance and torch both release the GIL):
        a future of {request_id: disallowed row}."""
        reqs = [c.request for c in chunks if c.completes and c.request.grammar is not None]
        if not reqs:
            return None
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")

        def masks() -> dict:
            rows = disallowed_rows([r.grammar for r in reqs])
            return {r.request_id: row for r, row in zip(reqs, rows)}
        return self._mask_pool.submit(masks)

    def _finish_speculative_step(self, completed, logits, guesses) -> list[RequestOutput]:
        rows, spec, row = [], [], 0
        for c in completed:
            if c.request.request_id in guesses:
                spec.append((c.request, logits[row:row + c.num_new_tokens]))
                row += c.num_new_tokens
            else:
                rows.append((c.request, row))
                row += 1
        reqs = [r for r, _ in rows]
        tokens, logprobs = sample(logits[[i for _, i in rows]], reqs) if reqs else ([], [])
        outs = [self._on_token(r, t, lp) for r, t, lp in zip(reqs, tokens, logprobs)]
        for req, req_logits in spec:
            for t in self.speculator.settle(req, guesses[req.request_id], req_logits):
                outs.append(self._on_token(req, t, None))
                if outs[-1].finished:
                    break
        return outs

    def _on_token(self, req: Request, token: int, lp: TokenLogprobs | None) -> RequestOutput:
        req.append_output(token)
        out = RequestOutput(req.request_id, [token], logprobs=[lp] if lp else [],
                            num_prompt_tokens=req.num_prompt_tokens,
                            num_cached_tokens=max(req.num_cached_tokens, 0))
        if len(req.output_token_ids) == 1:
            if req.params.prompt_logprobs is not None:
                out.prompt_logprobs = list(req.prompt_logprobs or [])
            if req.first_scheduled_time is not None:
                out.queue_s = req.first_scheduled_time - req.arrival_time
        status = None
        p = req.params
        if len(req.output_token_ids) <= p.min_tokens:
            pass  # too early to stop (the sampler masks the stop tokens; this covers an imported one)
        elif token == req.eos_token_id and not p.ignore_eos:
            status = RequestStatus.FINISHED_STOPPED
        elif token in p.stop_token_ids:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        if req.grammar is not None and status is None:
            # masked sampling only picks allowed tokens; a refused one can only be an imported
            # first token from a prefill worker with another constraint: stop rather than drift
            if not req.grammar.consume(token) or req.grammar.done:
                status = RequestStatus.FINISHED_STOPPED
            elif why := req.grammar.over_budget(self.config.grammar_budget_s, self.config.grammar_step_budget_ms / 1e3):
                status, out.error = RequestStatus.FINISHED_ERROR, why
        detok = self._detok.get(req.request_id)
        if detok is not None:
            out.new_text = detok.push([token])
            if detok.stopped_on is not None and status is None:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, detok.stopped_on
        if status is None and len(req.output_token_ids) >= req.max_tokens:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            if detok is not None:
                out.new_text += detok.flush()
            self._finish(req, status)
            out.finished, out.finish_reason, out.stop_reason = True, status.finish_reason, req.stop_reason
        return out

    def _finish(self, req: Request, status: RequestStatus) -> None:
        hold = req.request_id in self._hold and status not in (RequestStatus.FINISHED_ABORTED,
                                                                RequestStatus.FINISHED_ERROR)
        self.scheduler.finish(req, status, free_blocks=not hold)
        if req.lora is not None:
            self.loras.release(req.lora)
        self._hold.discard(req.request_id)
        self._detok.pop(req.request_id, None)
        self._layer_streams.pop(req.request_id, None)
        if self.speculator is not None:
            self.speculator.release(req.request_id)
        if hold:
            self._held[req.request_id] = req

    # ---- conveniences ---------------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion in one continuous batch; returns generated token ids."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished_requests():
            for out in self.step():
                results[out.request_id].extend(out.new_token_ids)
        return [results[rid] for rid in ids]

    def cached_blocks(self) -> tuple[list[int], int]:
        """The cached blocks' hashes and the KV-event number they agree with."""
        return self.blocks.snapshot()

    def stats(self) -> EngineStats:
        """Blocks, queues and counters; call it on the engine's thread for a consistent snapshot."""
        sched, blocks, spec = self.scheduler, self.blocks, self.speculator
        queued = sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting) + sum(
            r.num_tokens - r.num_computed_tokens for r in sched.running if r.num_computed_tokens < r.num_tokens - 1)
        return EngineStats(
            num_blocks=blocks.num_blocks, free_blocks=blocks.num_free_blocks, cached_blocks=blocks.num_cached_blocks,
            kv_usage=blocks.usage, running=len(sched.running), waiting=len(sched.waiting),
            queued_prefill_tokens=queued, prefix_queries=blocks.prefix_queries, prefix_hits=blocks.prefix_hits,
            max_model_len=self.max_model_len, kv_cache_dtype=self.kv_cache.format.name,
            speculation="" if spec is None else spec.kind, spec_proposed=spec.proposed if spec else 0,
            spec_accepted=spec.accepted if spec else 0, preempted_memory=sched.preemptions["memory"],
            preempted_priority=sched.preemptions["priority"], **tier_stats(blocks))
