"""Every client of a store reads from the endpoint the user named: s3fs, obstore, the node cache's fetcher and
every DataLoader worker.  Two S3 servers hold different stores under the same keys; the environment names the
other one (AWS_ENDPOINT_URL_S3), and the test counts the requests that reach it: none may."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
from conftest import make_batch_loader
from s3_server import REGION, S3, bucket_fixture, running_s3, s3_fixture  # noqa: F401
from torch.utils.data import DataLoader

import h5feed
from h5feed import HiddenStatesDataset, Store
from h5feed.io import S3Store, open_url
from h5feed.io.s3 import S3Settings

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

LENGTHS = [24, 40, 17, 33]  # the same layout in both stores (uncompressed): only the bytes differ
N = len(LENGTHS)


@pytest.fixture(scope="module")
def other_s3() -> Iterator[S3]:
    """A second S3 server, with a proxy in front that logs every request reaching it."""
    with running_s3() as s3:
        yield s3


def upload(store_path, s3: S3, bucket: str) -> None:
    for path in sorted(store_path.rglob("*")):
        if path.is_file():
            s3.client.put_object(Bucket=bucket, Key=f"hs.zarr/{path.relative_to(store_path).as_posix()}",
                                 Body=path.read_bytes())


@pytest.fixture
def two_copies(synthetic_store, s3: S3, bucket: str, other_s3: S3, monkeypatch: pytest.MonkeyPatch):
    """The store the user means on `s3` (named in storage_options), another one at the same URL on
    `other_s3` (named by the environment); returns (url, the store's local copy)."""
    ours = synthetic_store("endpoint-a", "speculators-legacy-pt", N, 32, LENGTHS, codec="none", seed=1)
    theirs = synthetic_store("endpoint-b", "speculators-legacy-pt", N, 32, LENGTHS, codec="none", seed=2)
    upload(ours.path, s3, bucket)
    other_s3.client.create_bucket(Bucket=bucket)
    upload(theirs.path, other_s3, bucket)
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        monkeypatch.setenv(name, other_s3.proxy.url)
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    other_s3.proxy.reset()
    return f"s3://{bucket}/hs.zarr", ours.path


def same(got: dict, want: dict) -> bool:
    return all(torch.equal(got[k], want[k]) for k in want if isinstance(want[k], torch.Tensor))


def test_every_reader_uses_the_endpoint_in_storage_options(two_copies, s3: S3, other_s3: S3, tmp_path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    url, local = two_copies
    options = s3.storage_options
    caplog.set_level(logging.WARNING, "h5feed")

    store = Store(url, storage_options=options)
    reference = Store(local)
    for i in range(N):
        got, want = store.read_sample(i), reference.read_sample(i)
        assert torch.equal(got.aux_hidden_states, want.aux_hidden_states)
        assert torch.equal(got.last_hidden_state, want.last_hidden_state)

    want = [HiddenStatesDataset(local)[i] for i in range(N)]
    for cache_dir, method in ((None, "spawn"), (tmp_path / "cache", "spawn"), (None, "fork")):
        dataset = HiddenStatesDataset(h5feed.StoreOptions(url, storage_options=options, cache_dir=cache_dir))
        got = list(DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context=method))
        assert len(got) == N and all(same(g, w) for g, w in zip(got, want))

    kwargs = {"flavor": "speculators", "max_len": 64, "batch_size": 2, "seed": 3}
    want_batches = list(make_batch_loader(local, **kwargs, threads=2))
    for loader_kwargs in ({"num_workers": 2, "multiprocessing_context": "spawn"}, {"threads": 2}):
        got_batches = list(make_batch_loader(url, storage_options=options, cache_dir=tmp_path / "cache2", **kwargs,
                                             **loader_kwargs))
        assert len(got_batches) == len(want_batches)
        assert all(same(g, w) for g, w in zip(got_batches, want_batches))

    assert other_s3.proxy.requests() == []
    conflicts = [r.getMessage() for r in caplog.records if "AWS_ENDPOINT_URL_S3" in r.getMessage()]
    assert conflicts == [(f"{url}: storage_options' endpoint_url {s3.proxy.url} wins over AWS_ENDPOINT_URL_S3="
                          f"{other_s3.proxy.url} from the environment; unset one of them to silence this")]


def test_the_settings_are_resolved_once_and_travel(two_copies, s3: S3, other_s3: S3) -> None:
    """Explicit options win; what the options leave open comes from the environment; the result pickles."""
    url, _ = two_copies
    import pickle

    store = open_url(url, s3.storage_options)
    assert isinstance(store, S3Store)
    assert store.settings == S3Settings(endpoint_url=s3.proxy.url, region=REGION, key="testing", secret="testing")
    assert pickle.loads(pickle.dumps(store)).settings == store.settings

    from_env = S3Store(url, {"key": "testing", "secret": "testing"})
    assert from_env.settings == S3Settings(endpoint_url=other_s3.proxy.url, region="eu-west-3", key="testing",
                                           secret="testing")


def test_explicit_options_win_over_the_environment_and_the_rest_comes_from_it(caplog) -> None:
    env = {"AWS_ENDPOINT_URL": "http://general:1", "AWS_ENDPOINT_URL_S3": "http://s3-only:2",
           "AWS_DEFAULT_REGION": "eu-north-1", "AWS_REGION": "eu-west-3", "AWS_PROFILE": "theirs"}
    caplog.set_level(logging.WARNING, "h5feed")
    assert S3Settings.resolve("s3://b/x", {}, env) == S3Settings(endpoint_url="http://s3-only:2", region="eu-west-3")
    assert S3Settings.resolve("s3://b/x", {}, {"AWS_ENDPOINT_URL": "http://general:1"}).endpoint_url == \
        "http://general:1"
    assert caplog.records == []  # nothing to choose between
    options = {"client_kwargs": {"endpoint_url": "http://mine:3", "region_name": "ap-south-1"}, "profile": "mine",
               "anon": True}
    assert S3Settings.resolve("s3://b/y", options, env) == S3Settings(
        endpoint_url="http://mine:3", region="ap-south-1", profile="mine", anon=True)
    assert [r.getMessage() for r in caplog.records] == [
        ("s3://b/y: storage_options' profile mine wins over AWS_PROFILE=theirs from the environment; unset one of "
        "them to silence this"),
        ("s3://b/y: storage_options' endpoint_url http://mine:3 wins over AWS_ENDPOINT_URL_S3=http://s3-only:2 from "
        "the environment; unset one of them to silence this"),
        ("s3://b/y: storage_options' client_kwargs.region_name ap-south-1 wins over AWS_REGION=eu-west-3 from the "
        "environment; unset one of them to silence this"),
    ]
    S3Settings.resolve("s3://b/y", options, env)
    assert len(caplog.records) == 3  # once
    assert "testing" not in repr(S3Settings(key="k", secret="testing", token="testing"))


def test_an_endpoint_in_the_aws_config_file_reaches_every_client(tmp_path, monkeypatch) -> None:
    """botocore (s3fs) honours an endpoint in the profile's `services` section; obstore would not read it."""
    config = tmp_path / "config"
    config.write_text("[profile lab]\nservices = lab-services\nregion = eu-south-2\n\n"
                      "[services lab-services]\ns3 =\n  endpoint_url = http://lab:9000\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    assert S3Settings.resolve("s3://b/x", {"profile": "lab"}) == S3Settings(
        endpoint_url="http://lab:9000", region="eu-south-2", profile="lab")
    monkeypatch.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")
    assert S3Settings.resolve("s3://b/x", {"profile": "lab"}).endpoint_url is None
