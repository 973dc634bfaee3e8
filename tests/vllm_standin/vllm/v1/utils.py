"""``vllm.v1.utils.APIServerProcessManager`` of vLLM 0.32.0: how ``vllm serve`` with several API servers starts
and stops them, with vLLM's bodies (``__init__`` only as far as the processes go).

vLLM's main process (``run_multi_api_server``) makes one on start-up and calls ``shutdown`` on SIGTERM, with
``--shutdown-timeout`` (0 by default): each API server gets SIGTERM, and SIGKILL once the timeout has passed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any


class APIServerProcessManager:
    """Manages a group of API server processes."""

    def __init__(
        self,
        listen_address: str,
        sock: Any,
        args: argparse.Namespace,
        num_servers: int,
        input_listeners: list[Any],
        output_listeners: list[Any],
        target_server_fn: Callable | None = None,
        stats_update_address: str | None = None,
        tensor_queue: Any = None,
    ) -> None:
        spawn_context = multiprocessing.get_context("spawn")
        self.processes: list[BaseProcess] = []
        for index, input_listener, output_listener in zip(
            range(num_servers), input_listeners, output_listeners, strict=True
        ):
            client_config = {
                "input_address": input_listener.address,
                "output_address": output_listener.address,
                "client_count": num_servers,
                "client_index": index,
            }
            process = spawn_context.Process(
                target=target_server_fn, name=f"ApiServer_{index}", args=(listen_address, sock, args, client_config)
            )
            self.processes.append(process)
            process.start()

    def shutdown(self, timeout: float | None = None) -> None:
        """Shutdown API server processes with configurable timeout"""
        if timeout is None:
            timeout = 5.0
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + timeout
        for process in self.processes:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if process.is_alive():
                process.join(remaining)
        for process in self.processes:
            if process.is_alive():
                process.kill()
