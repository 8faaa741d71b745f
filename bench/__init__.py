"""The benchmark lab behind `pdserve bench*`: a serving client for any OpenAI endpoint
(`serving`: TTFT/ITL/TPOT, goodput, rate sweeps) with its workloads (`workloads`), metrics
and tables (`metrics`) and plots (`plots`); pdserve against its peers in one run (`peers`)
and the transformers baseline behind the same API (`baseline_server`); the engine
(`engine`), the cluster (`cluster`) and the KV hand-off (`transfer`) measured alone.
`experiments/` holds one-off studies, each with the results it wrote; `NOTES.md` the
figures behind each optimization."""
