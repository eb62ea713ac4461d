"""The loopback fake Hub (tests/hub_server.py) against the REAL huggingface_hub 2.4 and transformers clients.

Nothing is mocked: every test below goes through huggingface_hub's own HTTP stack (httpx2) to 127.0.0.1. The
``hf_hub`` fixture points this process at the server (see ``use_hub``); ``test_subprocess_env`` shows the
``HF_ENDPOINT`` way for child processes. Several tests pin down what huggingface_hub 2.4 actually does on faults
(resume granularity, no retry on RST, no content verification): if one fails after an upgrade, the client changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import time

import httpx2
import pytest
import torch
import transformers
from huggingface_hub import (
    HfApi,
    HfFileSystem,
    constants,
    get_hf_file_metadata,
    get_session,
    hf_hub_download,
    hf_hub_url,
    snapshot_download,
)
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

from hub_server import HubServer, git_blob_sha1

REPO = "org/name"
CONFIG = json.dumps({"model_type": "gpt2", "n_embd": 16}).encode()
WEIGHTS = random.Random(0).randbytes(1_500_000)  # > 1 MB: "large" (LFS-like) for the default threshold
NOTES = b"small file in a folder\n"


def add_main(server: HubServer) -> str:
    return server.add_repo(REPO, {"config.json": CONFIG, "model.safetensors": WEIGHTS, "sub/notes.txt": NOTES})


def cache_home(tmp_path):
    return tmp_path / "hf_home" / "hub" / "models--org--name"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_hf_hub_download_small_and_large(hf_hub, tmp_path):
    sha = add_main(hf_hub)
    storage = cache_home(tmp_path)

    small = hf_hub_download(REPO, "config.json")
    large = hf_hub_download(REPO, "model.safetensors")

    assert small == str(storage / "snapshots" / sha / "config.json")
    assert large == str(storage / "snapshots" / sha / "model.safetensors")
    assert (storage / "refs" / "main").read_text() == sha
    # blobs are named by the ETag: git blob sha1 for small files, sha256 for large (X-Linked-Etag) ones
    assert os.path.realpath(small) == str(storage / "blobs" / git_blob_sha1(CONFIG))
    assert os.path.realpath(large) == str(storage / "blobs" / sha256(WEIGHTS))
    assert open(small, "rb").read() == CONFIG and open(large, "rb").read() == WEIGHTS

    meta = get_hf_file_metadata(hf_hub_url(REPO, "model.safetensors"))
    assert (meta.etag, meta.commit_hash, meta.size, meta.xet_file_data) == (sha256(WEIGHTS), sha, len(WEIGHTS), None)
    head = get_session().head(hf_hub_url(REPO, "model.safetensors"))
    assert head.headers["X-Linked-Etag"] == f'"{sha256(WEIGHTS)}"' and "X-Xet-Hash" not in head.headers
    assert get_session().head(hf_hub_url(REPO, "config.json")).headers["ETag"] == f'"{git_blob_sha1(CONFIG)}"'

    seen = [(r.method, r.filename, r.status, r.bytes_sent) for r in hf_hub.requests]
    assert seen[:4] == [
        ("HEAD", "config.json", 200, 0),
        ("GET", "config.json", 200, len(CONFIG)),
        ("HEAD", "model.safetensors", 200, 0),
        ("GET", "model.safetensors", 200, len(WEIGHTS)),
    ]
    assert hf_hub.bytes_for(REPO, "model.safetensors") == len(WEIGHTS)
    assert hf_hub.bytes_sent == len(CONFIG) + len(WEIGHTS)

    # cached: a branch costs one HEAD, a commit sha costs nothing
    hf_hub.reset_counters()
    assert hf_hub_download(REPO, "model.safetensors") == large
    assert hf_hub_download(REPO, "model.safetensors", revision=sha) == large
    assert [(r.method, r.bytes_sent) for r in hf_hub.requests] == [("HEAD", 0)]


def test_snapshot_download_branches_and_api(hf_hub, tmp_path):
    sha = add_main(hf_hub)
    storage = cache_home(tmp_path)

    folder = snapshot_download(REPO)
    assert folder == str(storage / "snapshots" / sha)
    assert open(os.path.join(folder, "sub", "notes.txt"), "rb").read() == NOTES
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors", "sub"]

    dev = hf_hub.add_revision(REPO, "dev", {"config.json": b"{}", "model.safetensors": WEIGHTS[:10]})
    pr = hf_hub.add_revision(REPO, "refs/pr/1", {"config.json": b'{"pr": 1}'})
    assert len({sha, dev, pr}) == 3
    assert snapshot_download(REPO, revision="dev") == str(storage / "snapshots" / dev)
    assert (storage / "refs" / "dev").read_text() == dev
    hf_hub.reset_counters()
    assert open(hf_hub_download(REPO, "config.json", revision="refs/pr/1"), "rb").read() == b'{"pr": 1}'
    assert hf_hub.requests[0].path == "/org/name/resolve/refs%2Fpr%2F1/config.json"

    api = HfApi()
    info = api.model_info(REPO)
    assert (info.id, info.sha) == (REPO, sha)
    assert sorted(s.rfilename for s in info.siblings) == ["config.json", "model.safetensors", "sub/notes.txt"]
    assert api.model_info(REPO, revision="dev").sha == dev
    assert api.model_info(REPO, revision=pr).sha == pr
    lfs = {s.rfilename: s.lfs for s in api.model_info(REPO, files_metadata=True).siblings}
    assert lfs["config.json"] is None and lfs["model.safetensors"].sha256 == sha256(WEIGHTS)

    tree = {e.path: e for e in api.list_repo_tree(REPO, recursive=True)}
    assert sorted(tree) == ["config.json", "model.safetensors", "sub", "sub/notes.txt"]
    assert tree["model.safetensors"].lfs.size == len(WEIGHTS) and tree["model.safetensors"].size == len(WEIGHTS)
    assert tree["config.json"].blob_id == git_blob_sha1(CONFIG) and tree["config.json"].lfs is None
    assert [e.path for e in api.list_repo_tree(REPO, "sub")] == ["sub/notes.txt"]
    assert [e.path for e in api.get_paths_info(REPO, ["config.json", "sub", "missing"])] == ["config.json", "sub"]

    refs = api.list_repo_refs(REPO, include_pull_requests=True)
    assert {b.name: b.target_commit for b in refs.branches} == {"main": sha, "dev": dev}
    assert [(p.ref, p.target_commit) for p in refs.pull_requests] == [("refs/pr/1", pr)]
    assert [c.commit_id for c in api.list_repo_commits(REPO, revision="dev")] == [dev, sha]
    assert api.file_exists(REPO, "sub/notes.txt") and not api.file_exists(REPO, "nope.txt")
    assert api.revision_exists(REPO, "dev") and not api.revision_exists(REPO, "nope")


def test_not_found_kinds(hf_hub, tmp_path):
    sha = add_main(hf_hub)
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("org/missing", "config.json")
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(REPO, "config.json", revision="nope")
    with pytest.raises(RemoteEntryNotFoundError) as excinfo:
        hf_hub_download(REPO, "nope.json")
    assert isinstance(excinfo.value, EntryNotFoundError)
    assert (cache_home(tmp_path) / ".no_exist" / sha / "nope.json").exists()  # thanks to X-Repo-Commit on the 404

    api = HfApi()
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("org/missing")
    with pytest.raises(RevisionNotFoundError):
        api.model_info(REPO, revision="0" * 40)
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("org/missing")
    with pytest.raises(RevisionNotFoundError):
        snapshot_download(REPO, revision="nope")

    r = get_session().get(hf_hub_url(REPO, "nope.json"))
    assert (r.status_code, r.headers["X-Error-Code"], r.headers["X-Repo-Commit"]) == (404, "EntryNotFound", sha)
    assert "nope.json" in r.json()["error"]


def test_ranged_get_returns_and_counts_exact_bytes(hf_hub):
    add_main(hf_hub)
    url = hf_hub_url(REPO, "model.safetensors")
    headers = build_hf_headers()
    size = len(WEIGHTS)
    hf_hub.reset_counters()

    r = get_session().get(url, headers={**headers, "Range": "bytes=100-199"})
    assert (r.status_code, r.content, r.headers["Content-Range"]) == (206, WEIGHTS[100:200], f"bytes 100-199/{size}")
    assert hf_hub.bytes_sent == 100 and hf_hub.bytes_for(REPO, "model.safetensors") == 100
    assert get_session().get(url, headers={**headers, "Range": f"bytes={size - 5}-"}).content == WEIGHTS[-5:]
    assert get_session().get(url, headers={**headers, "Range": "bytes=-7"}).content == WEIGHTS[-7:]
    assert get_session().get(url, headers={**headers, "Range": f"bytes=10-{size * 2}"}).content == WEIGHTS[10:]
    assert hf_hub.bytes_sent == 100 + 5 + 7 + size - 10
    ranges = ["bytes=100-199", f"bytes={size - 5}-", "bytes=-7", f"bytes=10-{size * 2}"]
    assert [r.range for r in hf_hub.requests] == ranges

    for bad in ("bytes=0-1,5-6", f"bytes={size}-", "pages=1-2"):
        r = get_session().get(url, headers={**headers, "Range": bad})
        assert (r.status_code, r.headers["Content-Range"]) == (416, f"bytes */{size}")
        with pytest.raises(HfHubHTTPError):
            hf_raise_for_status(r)


@pytest.mark.parametrize("mode", ["cross", "same"])
def test_large_files_redirect_to_a_cdn(hf_hub, mode):
    sha = add_main(hf_hub)
    hf_hub.redirect_large = mode
    path = hf_hub_download(REPO, "model.safetensors", token="hf_fake_token")
    assert open(path, "rb").read() == WEIGHTS and os.path.basename(os.path.realpath(path)) == sha256(WEIGHTS)
    assert open(hf_hub_download(REPO, "config.json"), "rb").read() == CONFIG  # small files: no redirect

    reqs = hf_hub.requests_for("model.safetensors")
    cdn_path = f"/cdn/org/name/{sha}/model.safetensors"
    assert (reqs[0].method, reqs[0].status) == ("HEAD", 302)
    if mode == "cross":  # HEAD stops at the 302 (off-Hub origin); the GET goes to the other port without auth
        assert [(r.method, r.path, r.origin) for r in reqs[1:]] == [("GET", cdn_path, "cdn")]
        assert "authorization" not in reqs[1].headers
    else:  # same origin: the HEAD follows the redirect; auth is kept
        assert [(r.method, r.path, r.origin) for r in reqs[1:]] == [("HEAD", cdn_path, "hub"), ("GET", cdn_path, "hub")]
        assert reqs[2].headers["authorization"] == "Bearer hf_fake_token"
    assert reqs[-1].bytes_sent == len(WEIGHTS)
    assert [(r.method, r.status) for r in hf_hub.requests_for("config.json")] == [("HEAD", 200), ("GET", 200)]

    hf_hub.reset_counters()  # a plain ranged GET follows the redirect too
    r = get_session().get(hf_hub_url(REPO, "model.safetensors"), headers={"Range": "bytes=5-9"})
    assert (r.status_code, r.content) == (206, WEIGHTS[5:10])
    assert [(x.status, x.bytes_sent) for x in hf_hub.requests] == [(302, 0), (206, 5)] and hf_hub.bytes_sent == 5


def test_cut_connection_is_resumed_from_the_last_full_chunk(hf_hub):
    """huggingface_hub resumes a short body (RemoteProtocolError) after sleeping 1 s, but only from the last complete
    DOWNLOAD_CHUNK_SIZE (10 MiB) chunk it wrote: smaller files are downloaded again from byte 0."""
    chunk = constants.DOWNLOAD_CHUNK_SIZE
    huge = random.Random(1).randbytes(chunk + (2 << 20))
    add_main(hf_hub)
    hf_hub.update_files(REPO, {"huge.bin": huge})

    hf_hub.cut_next(chunk + (1 << 20), path="huge.bin")
    assert open(hf_hub_download(REPO, "huge.bin"), "rb").read() == huge
    gets = [(r.range, r.status, r.bytes_sent, r.cut) for r in hf_hub.requests_for("huge.bin", "GET")]
    assert gets == [(None, 200, chunk + (1 << 20), True), (f"bytes={chunk}-", 206, len(huge) - chunk, False)]

    hf_hub.cut_next(50_000, path="model.safetensors")
    assert open(hf_hub_download(REPO, "model.safetensors"), "rb").read() == WEIGHTS
    gets = [(r.range, r.status, r.bytes_sent, r.cut) for r in hf_hub.requests_for("model.safetensors", "GET")]
    assert gets == [(None, 200, 50_000, True), (None, 200, len(WEIGHTS), False)]
    assert hf_hub.bytes_for(REPO, "model.safetensors") == 50_000 + len(WEIGHTS)


def test_reset_connection_is_not_retried(hf_hub, tmp_path):
    """A TCP RST mid-body is an httpx2.ReadError, which hf_hub_download does not retry; nothing is left behind."""
    add_main(hf_hub)
    hf_hub.cut_next(1000, path="model.safetensors", mode="reset")
    with pytest.raises(httpx2.ReadError):
        hf_hub_download(REPO, "model.safetensors")
    assert not list((cache_home(tmp_path) / "blobs").iterdir())
    assert open(hf_hub_download(REPO, "model.safetensors"), "rb").read() == WEIGHTS  # the cut was for once


def test_remote_file_changes(hf_hub, tmp_path):
    sha = add_main(hf_hub)
    other = bytes(b ^ 0xFF for b in WEIGHTS)  # same size, other bytes

    # Swapped between the HEAD (plan) and the GET: same size goes unnoticed -- plain HTTP downloads are not hashed,
    # the new bytes are cached under the OLD sha256.
    hf_hub.replace_file(REPO, "model.safetensors", other, when="head")
    path = hf_hub_download(REPO, "model.safetensors")
    assert open(path, "rb").read() == other and os.path.basename(os.path.realpath(path)) == sha256(WEIGHTS)
    # ... another size is caught by the size check
    hf_hub.replace_file(REPO, "config.json", b"{}", when="head")
    with pytest.raises(OSError, match="Consistency check failed"):
        hf_hub_download(REPO, "config.json")

    # keep_etag: the server keeps advertising the old etag for new content
    hf_hub.replace_file(REPO, "sub/notes.txt", b"changed\n", keep_etag=True)
    assert get_hf_file_metadata(hf_hub_url(REPO, "sub/notes.txt")).etag == git_blob_sha1(NOTES)
    hf_hub.replace_file(REPO, "sub/notes.txt", b"changed\n")
    assert get_hf_file_metadata(hf_hub_url(REPO, "sub/notes.txt")).etag == git_blob_sha1(b"changed\n")

    # the server lies about the size (HEAD + API), GET framing stays true
    hf_hub.override_size(REPO, "sub/notes.txt", 3)
    assert HfApi().get_paths_info(REPO, ["sub/notes.txt"])[0].size == 3
    with pytest.raises(OSError, match="Consistency check failed"):
        hf_hub_download(REPO, "sub/notes.txt")
    hf_hub.override_size(REPO, "sub/notes.txt", None)

    # the honest Hub way: a new commit; main moves, the old commit keeps its bytes
    hf_hub.replace_file(REPO, "config.json", b'{"v": 2}', new_commit=True)
    new_sha = hf_hub.commit_sha(REPO)
    assert new_sha != sha
    path = hf_hub_download(REPO, "config.json")
    assert path == str(cache_home(tmp_path) / "snapshots" / new_sha / "config.json")
    assert open(path, "rb").read() == b'{"v": 2}'
    assert open(hf_hub_download(REPO, "model.safetensors", revision=sha), "rb").read() == other


def test_fail_next_and_throttle(hf_hub):
    add_main(hf_hub)
    # a 5xx on the HEAD: hf_hub_download falls back to a second HEAD with retries, and succeeds
    hf_hub.fail_next(503, path="config.json", methods=("HEAD",))
    assert open(hf_hub_download(REPO, "config.json"), "rb").read() == CONFIG
    seen = [(r.method, r.status) for r in hf_hub.requests_for("config.json")]
    assert seen == [("HEAD", 503), ("HEAD", 200), ("GET", 200)]
    # a 5xx on the GET is not retried (http_get only retries 408/429)
    hf_hub.fail_next(503, path="sub/*", methods=("GET",))
    with pytest.raises(HfHubHTTPError):
        hf_hub_download(REPO, "sub/notes.txt")

    hf_hub.throttle_bytes_per_s = 1_000_000
    start = time.monotonic()
    r = get_session().get(hf_hub_url(REPO, "model.safetensors"), headers={"Range": "bytes=0-399999"})
    elapsed = time.monotonic() - start
    assert r.content == WEIGHTS[:400_000] and 0.35 < elapsed < 3


def test_tree_pagination_and_reload(hf_hub):
    sha = add_main(hf_hub)
    hf_hub.tree_page_size = 2
    hf_hub.reset_counters()
    paths = [e.path for e in HfApi().list_repo_tree(REPO, recursive=True)]
    assert sorted(paths) == ["config.json", "model.safetensors", "sub", "sub/notes.txt"]
    assert [r.path.split("cursor=")[-1] if "cursor=" in r.path else None for r in hf_hub.requests] == [None, "2"]

    again = HubServer(hf_hub.root)  # a new server on the same root serves the same repos at the same shas
    assert again.commit_sha(REPO) == sha and again.file_etag(REPO, "model.safetensors") == sha256(WEIGHTS)


def test_accounting_per_client(hf_hub):
    add_main(hf_hub)
    hf_hub_download(REPO, "config.json", headers={"X-Client-Id": "a"})
    hf_hub_download(REPO, "sub/notes.txt", headers={"X-Client-Id": "b"})
    assert hf_hub.bytes_by_client == {"a": len(CONFIG), "b": len(NOTES)}
    assert hf_hub.bytes_by_file == {(REPO, "config.json"): len(CONFIG), (REPO, "sub/notes.txt"): len(NOTES)}


def test_hf_file_system_reads(hf_hub):
    add_main(hf_hub)
    fs = HfFileSystem(skip_instance_cache=True)
    assert sorted(fs.ls(REPO, detail=False)) == [f"{REPO}/config.json", f"{REPO}/model.safetensors", f"{REPO}/sub"]
    assert fs.info(f"{REPO}/model.safetensors")["lfs"]["sha256"] == sha256(WEIGHTS)
    assert fs.cat_file(f"{REPO}/sub/notes.txt") == NOTES
    hf_hub.reset_counters()
    with fs.open(f"{REPO}/model.safetensors", "rb", block_size=1000, cache_type="none") as f:
        f.seek(123_456)
        assert f.read(10) == WEIGHTS[123_456:123_466]
    assert [r.range for r in hf_hub.requests] == ["bytes=123456-123465"] and hf_hub.bytes_sent == 10


def test_transformers_from_pretrained(hf_hub, tmp_path):
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.save_pretrained(tmp_path / "tiny")
    hf_hub.lfs_patterns = HubServer.HF_DEFAULT_LFS_PATTERNS  # like a real Hub repo: *.safetensors is LFS
    sha = hf_hub.add_repo("org/tiny", tmp_path / "tiny")

    config = transformers.AutoConfig.from_pretrained("org/tiny")
    assert (config.model_type, config.n_embd) == ("gpt2", 16)
    loaded = transformers.AutoModelForCausalLM.from_pretrained("org/tiny")
    for (k, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), k
    # transformers 5 resolves the revision once (through the model_info API, or config.json when an earlier
    # load in this process already warmed its caches), then downloads the weights by commit sha
    assert {r.filename for r in hf_hub.requests if r.method == "GET" and r.filename} == {
        "config.json", "model.safetensors", "generation_config.json"}
    assert all(r.revision == sha for r in hf_hub.requests if r.filename == "model.safetensors")


def test_subprocess_env(hub_server, tmp_path):
    """In a child process HF_ENDPOINT works, as it is read when huggingface_hub is imported there."""
    sha = add_main(hub_server)
    code = (
        "from huggingface_hub import HfApi, hf_hub_download\n"
        "print(hf_hub_download('org/name', 'model.safetensors'))\n"
        "print(HfApi().model_info('org/name').sha)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=hub_server.subprocess_env(tmp_path / "home"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    path, info_sha = out.stdout.split()
    assert path == str(tmp_path / "home" / "hub" / "models--org--name" / "snapshots" / sha / "model.safetensors")
    assert info_sha == sha and open(path, "rb").read() == WEIGHTS
    assert hub_server.bytes_for(REPO, "model.safetensors") == len(WEIGHTS)


def test_stop_is_bounded_with_a_transfer_in_flight(tmp_path):
    server = HubServer(tmp_path / "root")
    add_main(server)
    server.start()
    server.throttle_bytes_per_s = 100_000  # the full file would take 15 s
    url = f"{server.url}/org/name/resolve/main/model.safetensors"
    errors = []

    def fetch():
        try:
            with httpx2.Client(timeout=10) as client:
                client.get(url)
        except Exception as e:  # noqa: BLE001 -- any transport error is the expected outcome
            errors.append(e)

    thread = threading.Thread(target=fetch)
    thread.start()
    time.sleep(0.3)
    start = time.monotonic()
    server.stop()
    thread.join(timeout=5)
    assert time.monotonic() - start < 3 and not thread.is_alive()
    assert errors and isinstance(errors[0], httpx2.TransportError)
    assert 0 < server.bytes_sent < len(WEIGHTS)
