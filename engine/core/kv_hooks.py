"""The engine's side of a KV hand-off: a prefill engine streams a prompt's KV layer by layer
or exports it whole and holds its blocks until released; a decode engine admits a request
whose prompt KV will be imported and lands it with the first token. A mixin of LLMEngine: it
uses the engine's scheduler, blocks, KV cache and requests."""
from __future__ import annotations

import ctypes

import torch

from pdserve.common.errors import KVTransferError
from pdserve.common.outputs import RequestOutput, TokenLogprobs
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.urgency import PAUSE_MIN_TOKENS
from pdserve.engine.kernels.native.step import Stopped as NativeStepStopped
from pdserve.engine.sampling.sampler import draw


class StepStopped(Exception):
    """Raised at a layer's end by `between_layers` when a more urgent request has come while a
    long step of less urgent work runs: the step stops there and counts for nothing
    (`Scheduler.undo`), so the urgent request waits for one layer, not for the whole step. A
    shorter step that runs as one native call stops the same way (NativeStepStopped), at a
    layer's end where it reads its `StopWord`."""


class StopWord:
    """Whether a step in flight should stop for a request that came meanwhile, as an int32 that
    the one-call native step reads at each layer's end (engine/kernels/native/step.c; a long
    step's `between_layers` asks `stops`): `word`
    is the most urgent priority that arrived since the step began (NONE: none), `threshold`
    the most urgent priority of the step; the step stops when word < threshold."""

    NONE = 2 ** 31 - 1

    def __init__(self):
        self.word = ctypes.c_int32(self.NONE)
        self.threshold = 0

    def note(self, priority: int) -> None:
        """A request of `priority` arrived (any thread)."""
        if priority < self.word.value:  # no write otherwise: it could undo a clear made meanwhile
            self.word.value = priority

    def clear(self) -> None:
        self.word.value = self.NONE

    def stops(self) -> bool:
        return self.word.value < self.threshold

    def native(self) -> tuple[int, int]:
        """(the word's address, the threshold), as step.run takes them."""
        return ctypes.addressof(self.word), self.threshold


class KVTransferHooks:
    between_layers = None
    """Called at each layer's end of a step of more than PAUSE_MIN_TOKENS prompt tokens (or of
    any prompt tokens, if it streams KV out), with whether the step may stop there: it may block (the worker lends its cores to a peer's
    urgent step) or, if the step may stop, raise StepStopped (engine/core/async_engine.py)."""
    stop_word: StopWord | None = None
    """Read at each layer's end by a shorter step that may stop and runs as one native call (a
    decode step, a small chunk): it stops there when the word says so (engine/core/async_engine.py
    writes it). None: such steps run to their end."""

    def stream_kv_layers(self, request_id: str, on_layers, group: int = 6, first_block: int = 0) -> None:
        """Layer-wise KV streaming: in the step that finishes `request_id`'s prompt, call
        `on_layers(start, end, kv)` on the engine thread as soon as layers [start, end) have
        written their K/V (every `group` layers), kv being a copy of those layers of the
        request's blocks from `first_block` on, (end - start, 2, n_blocks, block_size, heads,
        head_dim). Transfer then overlaps the compute of the layers after them."""
        self._layer_streams[request_id] = (on_layers, max(1, group), first_block)

    def stop_kv_stream(self, request_id: str) -> None:
        self._layer_streams.pop(request_id, None)

    def _execute(self, sched, guesses: dict, masks):
        """The step's pass (`runner.execute`) with its layer hook: (completing chunks, logits),
        or None if it stopped at a layer's end for a more urgent request (StepStopped, or
        NativeStepStopped from the one-call native step; only a step without speculation whose
        blocks are its own, `Scheduler.can_stop`): then nothing it computed counts
        (`Scheduler.undo`; the K/V it stored is overwritten when its chunks run again)."""
        may_stop = not guesses and self.scheduler.can_stop(sched)
        try:
            return self.runner.execute(sched.chunks, self._layer_hook(sched.chunks, may_stop), frozenset(guesses))
        except (StepStopped, NativeStepStopped):
            if masks is not None:
                masks.result()  # its grammar thread is done with the grammars before the next step's
            self.scheduler.undo(sched)
            return None

    def _layer_hook(self, chunks, may_stop: bool = False):
        """The per-layer callback of a step, if a streamed request's prompt completes in it (in
        a tensor-parallel group every rank runs it: the step carries `tp_plan`, and each export
        gathers the ranks' heads), or if the step is a long one that may pause (`between_layers`;
        not in a group, whose ranks would wait in their next collective). `may_stop`: the step
        may stop at a layer's end (StepStopped) when no KV streams out of it; a shorter step
        then gets a hook that only carries the stop word (`_native_stop`)."""
        streams = [(c.request, *self._layer_streams.pop(c.request.request_id)) for c in chunks
                   if c.completes and c.request.request_id in self._layer_streams]
        # prompt tokens only: a decode-only step of any size keeps the one-call C step (no hook,
        # or one that only stops it); a step that streams KV out runs the layer loop anyway, so
        # it pauses however short (a prompt's last 30-60 tokens, ~40 ms on a shared core, held
        # an urgent peer's 2-thread steps at 18-20 ms instead of 3-4)
        prompt = sum(c.num_new_tokens for c in chunks if c.num_new_tokens > 1)
        pause = self.between_layers if self.tp is None and (
            prompt > PAUSE_MIN_TOKENS or (streams and prompt > 0)) else None
        if not streams:  # a step that streams KV out never stops midway: its layers already left
            if pause is not None:
                return _within_layers(lambda i: pause(may_stop), lambda: pause(may_stop))
            return self._native_stop() if may_stop and self.tp is None else None
        from pdserve.engine.parallel.tp import layer_streams
        plan = [(self.blocks.block_table(req.request_id)[first_block:], group) for req, _, group, first_block in streams]
        kw = {"announce": False} if self.tp is not None else {}  # the other ranks export in their own pass

        def export(k, blocks, layers):
            streams[k][1](*layers, self.kv_cache.export_blocks(blocks, layers=layers, **kw))
        after_layer = layer_streams(plan, self.model_config.num_hidden_layers, export)
        after_layer.tp_plan = plan
        if pause is None:
            return after_layer

        def export_then_pause(i: int) -> None:
            after_layer(i)
            pause(False)
        return _within_layers(export_then_pause, lambda: pause(False))

    def _native_stop(self):
        """The hook of a shorter step that may stop: the one-call native step reads its
        `native_stop` (the stop word's address, the step's threshold) at each layer's end
        and stops there (NativeStepStopped) if a more urgent request came; the Python layer
        loop calls it at each layer's end and it stops the step the same way (StepStopped).
        That loop runs the steps the C step does not: on an AMX CPU every step with prompt
        rows, such as a decode batch with a remotely prefilled prompt's last few tokens,
        which took 60-120 ms on a decode worker beside a 24-stream flood while an urgent
        request waited for its end. None without a stop word."""
        word = self.stop_word
        if word is None:
            return None
        last = self.model_config.num_hidden_layers - 1

        def hook(i: int) -> None:
            if i < last and word.stops():  # after the last layer the step is as good as done
                raise StepStopped(f"a request of priority {word.word.value} came during a step for {word.threshold}")
        hook.native_stop = word.native()
        return hook

    def export_kv(self, request_id: str) -> tuple[list[int], torch.Tensor]:
        """The held request's computed tokens and the KV of their blocks,
        (layers, 2, n_blocks, block_size, n_kv_heads, head_dim)."""
        req = self._held.get(request_id)
        if req is None:
            raise KVTransferError(f"request {request_id!r} holds no KV (add it with hold_kv=True)")
        return req.all_token_ids[:req.num_computed_tokens], self.kv_cache.export_blocks(self.blocks.block_table(request_id))

    def release_kv(self, request_id: str) -> bool:
        """Free a held request's blocks (after export)."""
        if self._held.pop(request_id, None) is None:
            return False
        self.blocks.free(request_id)
        return True

    def add_remote_request(self, request_id: str, prompt: list[int], params: SamplingParams | None = None,
                           lora: str | None = None) -> list[int] | None:
        """Admit a request whose prompt KV will be imported, under LoRA adapter `lora` (None:
        the base model; its cached prefix is looked up under the adapter's identity). Returns
        the block ids to fill: those after the prefix this engine already caches (shared, not
        sent again); None if the blocks are not free now (retry later)."""
        params = params or SamplingParams()
        # its grammar once admitted: under KV pressure a hand-off is refused and retried many times
        req = self._make_request(request_id, prompt, params, lora, grammar=False)
        if not self.scheduler.add_remote(req):
            self._detok.pop(request_id, None)
            if req.lora is not None:  # it never ran: give its adapter back
                self.loras.release(req.lora)
            return None
        try:
            req.grammar = self._grammar(params)
        except BaseException:
            self.abort(request_id)  # its blocks and seat back
            raise
        return self.blocks.block_table(request_id)[req.num_cached_tokens // self.blocks.block_size:]

    def import_kv(self, request_id: str, kv: torch.Tensor, first_token: int,
                  logprob: TokenLogprobs | None = None,
                  prompt_logprobs: list[TokenLogprobs] | None = None) -> RequestOutput:
        """Write the prompt KV into the request's blocks and continue from `first_token`
        (sampled by the prefill side, which computed `prompt_logprobs` too if the request
        asks for them). The request then decodes in the batch."""
        req = self.scheduler.remote.get(request_id)
        if req is None:
            raise KVTransferError(f"request {request_id!r} is not waiting for remote KV")
        table = self.blocks.block_table(request_id)
        if kv.dim() != 6 or kv.shape[2] > len(table):
            raise KVTransferError(f"KV for {request_id!r} has shape {tuple(kv.shape)}: more blocks than its {len(table)}")
        self.kv_cache.import_blocks(table[len(table) - kv.shape[2]:], kv)  # the uncached tail
        self.scheduler.remote_kv_ready(req)
        if prompt_logprobs is not None:
            req.prompt_logprobs = list(prompt_logprobs)
        if not req.params.greedy:
            # the prefill side drew the first token from the same seeded stream: skip that
            # draw so that the rest equals a single-engine run
            draw(req)
        return self._on_token(req, first_token, logprob)


def _within_layers(hook, within):
    """`hook` (called at each layer's end) that also carries `within`, which the layer loop
    calls inside each layer (after its attention, after its MLP's first matmul): a peer's
    urgent step then waits for a part of a layer, not a whole one. On one core of the Xeon a
    128-token chunk's layer takes 6-15 ms, three quarters of it in the MLP, and each urgent
    request's first step waited 7 ms (p50) for the layer in flight to end."""
    hook.within = within
    return hook
