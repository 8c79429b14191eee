"""What a host serves. Each engine is one module keeping base.py's contract (its payload, image, argv, profile
rules, and how its replies, /props, /tokenize and cache read), named in registry.py; every other layer asks
`registry.engine_of(profile)` and never which engine it holds, nor knows its flags.

Every engine's files on a host live under one layout, which the image's host scripts share."""

RUN_DIR = "fleet-run"  # on the host, beside the models: the API key file, the server's PID and log
MODELS_DIR = "models"
TEMPLATE_FILE = f"{RUN_DIR}/chat-template.jinja"  # the chat template fleet puts on the host, when a profile names one
# The host's TLS key (made there, never read by fleet) and the certificate fleet's CA signed for it
TLS_KEY_FILE = f"{RUN_DIR}/tls.key"
TLS_CERT_FILE = f"{RUN_DIR}/tls.pem"
# A host reuses a cached prompt only for requests of the same salt, which fleet's gateway sets per agent in this
# header: llama-server through --cache-salt-header (patch 0005), vLLM through the image's fleet_vllm_salt
CACHE_SALT_HEADER = "x-fleet-cache-salt"
# The server's port inside the host. An ordinary port: vast.ai maps it to a random external port on the
# public IP and lists that in the instance's `ports` (an identity port above 70000 is never listed there).
SERVICE_PORT = 18080
