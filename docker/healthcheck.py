"""The image's HEALTHCHECK: exit 0 when the exporter answers ``/-/healthy`` on its own listen address.

Slim images have no curl; this uses the standard library only and follows
CACHE_CONFIG_EXPORTER_WEB_LISTEN_ADDRESS, so a changed port stays checked.
"""

import os
import sys
import urllib.request

address = os.environ.get("CACHE_CONFIG_EXPORTER_WEB_LISTEN_ADDRESS", "0.0.0.0:10987")
host, _, port = address.rpartition(":")
host = host.removeprefix("[").removesuffix("]")
if host in ("", "0.0.0.0", "::"):
    host = "127.0.0.1"
if ":" in host:
    host = f"[{host}]"
try:
    with urllib.request.urlopen(f"http://{host}:{port}/-/healthy", timeout=4) as response:
        sys.exit(0 if response.status == 200 else 1)
except OSError as error:
    print(f"unhealthy: {error}", file=sys.stderr)
    sys.exit(1)
