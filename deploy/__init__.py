"""The `pdserve` command line: try the engine (generate, chat), measure it (bench-engine);
later issues add launching and scaling the prefill and decode pools."""
