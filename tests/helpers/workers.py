"""A prefill and a decode worker over real gRPC on loopback around two engines, and the
prompts the worker tests send through them."""

import grpc

from pdserve.decode_worker.service import DecodeWorker
from pdserve.engine.core.async_engine import AsyncEngine
from pdserve.common.sampling_params import SamplingParams
from pdserve.kv_transfer.senders import SchemeKVSender
from pdserve.prefill_worker.service import PrefillWorker
from pdserve.protos import worker_pb2 as pb
from pdserve.protos import worker_pb2_grpc as pb_grpc
from pdserve.protos.convert import params_to_proto
from pdserve.kv_transfer.config import TransferConfig
from pdserve.protos.security import SecurityConfig

PROMPTS = [[(11 * i + j) % 500 + 3 for j in range(18 + 21 * i)] for i in range(3)]
PARAMS = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True, logprobs=2),
          SamplingParams(max_tokens=9, temperature=1.0, seed=11, ignore_eos=True)]


class Cluster:
    def __init__(self, make_engine, token="", policy="recompute", threshold=0, decode_kv=4 << 20, kv_transport="grpc",
                 decode_block_size=16, layer_group=0, prefill_budget=512, kv_cache_dtype="auto",
                 decode_kv_cache_dtype="", wire_dtype="auto", convert_kv=True, transfer_timeout=30.0,
                 prefill_timeout=600.0):
        self.prefill_engine = make_engine(max_num_batched_tokens=prefill_budget, kv_cache_dtype=kv_cache_dtype)
        self.decode_engine = make_engine(kv_cache_memory=decode_kv, block_size=decode_block_size,
                                         kv_cache_dtype=decode_kv_cache_dtype or kv_cache_dtype)
        transfer = TransferConfig(transport=kv_transport, layer_group=layer_group, policy=policy,
                                  local_prefill_threshold=threshold, wire_dtype=wire_dtype,
                                  kv_dtype_mismatch="convert" if convert_kv else "refuse", timeout_s=transfer_timeout,
                                  prefill_timeout_s=prefill_timeout)
        security = SecurityConfig(cluster_token=token)
        self.prefill = PrefillWorker(AsyncEngine(self.prefill_engine), SchemeKVSender("prefill-0", token), "prefill-0",
                                     transfer=transfer, security=security)
        self.decode = DecodeWorker(AsyncEngine(self.decode_engine), "decode-0", transfer=transfer, security=security)
        self.token = token

    async def __aenter__(self):
        await self.prefill.start()
        await self.decode.start()
        self.channel = grpc.aio.insecure_channel(self.decode.address)
        self.stub = pb_grpc.DecodeServiceStub(self.channel)
        return self

    async def __aexit__(self, *exc):
        await self.channel.close()
        await self.decode.stop()
        await self.prefill.stop()

    async def generate(self, rid, prompt, params, prefill=True, token=None):
        req = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=params_to_proto(params),
                                 prefill_address=self.prefill.address if prefill is True else (prefill or ""),
                                 cluster_token=self.token if token is None else token)
        tokens, last = [], None
        async for msg in self.stub.Generate(req):
            tokens += list(msg.token_ids)
            last = msg
        return tokens, last


def expected(make_engine):
    eng = make_engine()
    return [eng.generate([p], [sp])[0] for p, sp in zip(PROMPTS, PARAMS)]
