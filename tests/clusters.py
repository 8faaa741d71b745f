from tests.helpers.clusters import MODEL, TLS_NAME, local_config, write_identity  # noqa: F401  (test_fuzz_api.py)
