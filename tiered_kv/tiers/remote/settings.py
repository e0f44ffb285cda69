"""Settings of the remote tier: where the Redis Cluster is, how to log in, how long to wait.

``RemoteSettings`` is built from the config keys of every front end (``remote_url``,
``remote_password_env``, ``remote_user``, the timeouts...), which ``RemoteKeys`` declares once for
the store's, the vLLM connector's and the SGLang backend's configs. The password itself is never a config
value: the config names an environment variable that holds it, so it never lands in a config
file, a log line or vLLM's printed config. ``seeds()`` parses ``remote_url``: a comma-separated
list of ``redis://host:port`` (or ``rediss://`` for TLS) seed nodes of one cluster.

Threading contract: immutable values; safe from any thread.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlsplit

from tiered_kv.errors import ConfigError
from tiered_kv.values.config_keys import config_key

REMOTE_WRITES = ("through", "evict")


@dataclass(frozen=True)
class RemoteSettings:
    """How to reach and use one Redis Cluster (see docs/remote.md for each field)."""

    url: str
    password_env: str | None = None
    user: str | None = None
    tls_ca: str | None = None
    connect_timeout_s: float = 0.5
    op_timeout_s: float = 2.0
    retry_after_s: float = 1.0
    key_prefix: str = "tkv:"
    stream_maxlen: int = 200_000

    def __post_init__(self) -> None:
        self.seeds()  # validates the url
        for name in ("connect_timeout_s", "op_timeout_s", "retry_after_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 600:
                raise ConfigError(f"remote {name}: expected seconds in (0, 600], got {v!r}")
            object.__setattr__(self, name, float(v))
        for name in ("password_env", "user", "tls_ca"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ConfigError(f"remote {name}: expected a non-empty string or null, got {v!r}")
        if not isinstance(self.key_prefix, str) or not self.key_prefix or "{" in self.key_prefix:
            raise ConfigError(f"remote key_prefix: expected a non-empty string without '{{', got {self.key_prefix!r}")
        if isinstance(self.stream_maxlen, bool) or not isinstance(self.stream_maxlen, int) or self.stream_maxlen < 1:
            raise ConfigError(f"remote stream_maxlen: expected an int >= 1, got {self.stream_maxlen!r}")
        if self.tls_ca is not None:
            self._check_tls_ca()

    def _check_tls_ca(self) -> None:
        """ConfigError unless ``tls_ca`` goes with ``rediss://`` seeds and names a readable file."""
        if not self.tls:
            raise ConfigError(f"remote_tls_ca is set ({self.tls_ca!r}) but remote_url uses redis:// (no TLS): use "
                              f"rediss:// seeds for a TLS cluster, or drop remote_tls_ca")
        if not os.path.isfile(self.tls_ca) or not os.access(self.tls_ca, os.R_OK):
            raise ConfigError(f"remote_tls_ca: {self.tls_ca!r} is not a readable file; give the PEM file of the CA "
                              f"that signed the Redis nodes' certificates")

    @property
    def tls(self) -> bool:
        """Whether the seeds use ``rediss://`` (TLS)."""
        return self.url.strip().startswith("rediss://")

    def seeds(self) -> list[tuple[str, int]]:
        """``(host, port)`` of each seed node in ``url``; ConfigError for anything else."""
        if not isinstance(self.url, str) or not self.url.strip():
            raise ConfigError(f"remote_url: expected 'redis://host:port[,redis://host:port...]', got {self.url!r}")
        out, schemes = [], set()
        for part in self.url.split(","):
            part = part.strip()
            u = urlsplit(part if "://" in part else "redis://" + part)
            schemes.add(u.scheme)
            if u.scheme not in ("redis", "rediss"):
                raise ConfigError(f"remote_url: {part!r} must start with redis:// or rediss:// (TLS)")
            if u.password is not None:
                raise ConfigError("remote_url: holds a password; put it in an environment variable and name that "
                                  "variable in remote_password_env instead")
            if u.username:
                raise ConfigError("remote_url: holds a user name; set remote_user instead")
            try:
                port = u.port or 6379
            except ValueError:
                raise ConfigError(f"remote_url: {part!r} has a bad port") from None
            if not u.hostname or u.path not in ("", "/"):
                raise ConfigError(f"remote_url: {part!r} must be redis://host:port (no database number: a "
                                  f"cluster has only database 0)")
            out.append((u.hostname, port))
        if len(schemes) > 1:
            raise ConfigError(f"remote_url: mixes redis:// and rediss:// seeds ({self.url!r}); use one scheme")
        return out

    def password(self) -> str | None:
        """The password from the environment variable ``password_env`` (None without one).

        ConfigError when the variable is named but not set: a typo would otherwise show up as an
        authentication error with no hint.
        """
        if self.password_env is None:
            return None
        value = os.environ.get(self.password_env)
        if value is None:
            raise ConfigError(f"remote_password_env names ${self.password_env}, which is not set in this process's "
                              f"environment; export it (the password of the Redis user) before starting")
        return value

    def describe(self) -> dict:
        """What stats and logs may show: seeds and settings, never the password."""
        return {"url": ",".join(f"{h}:{p}" for h, p in self.seeds()), "tls": self.tls, "user": self.user or "default",
                "password_env": self.password_env, "op_timeout_s": self.op_timeout_s,
                "connect_timeout_s": self.connect_timeout_s, "key_prefix": self.key_prefix}


@dataclass(frozen=True)
class RemoteKeys:
    """The ``remote_*`` config keys, shared by ``StoreConfig``, the vLLM connector's and the SGLang
    backend's configs (each inherits them; each key's meaning is its ``config_key``)."""

    remote_url: str | None = config_key(None, "seed nodes of the Redis Cluster shared by the fleet, comma-separated "
                                              "`redis://host:port` (`rediss://` for TLS): the remote tier, below "
                                              "disk (below CPU without a disk tier); docs/remote.md. `null`: no "
                                              "remote tier")
    remote_password_env: str | None = config_key(None, "name of the environment variable holding the Redis password "
                                                       "(never the password itself, which is never a config value "
                                                       "and never logged)")
    remote_user: str | None = config_key(None, "Redis ACL user (`null` = `default`)")
    remote_tls_ca: str | None = config_key(None, "CA file (PEM) for `rediss://` seeds; a node certificate it does not "
                                                 "verify fails start-up with `ConfigError`")
    remote_timeout_s: float = config_key(2.0, "bound on every Redis call; a node that failed is skipped (its reads "
                                              "miss) for 1 s, then retried; also the longest a vLLM scheduler waits "
                                              "at start-up for the presence feed to read the fleet's stream", "s")
    remote_connect_timeout_s: float = config_key(0.5, "bound on every connect to a Redis node (a node that failed is "
                                                      "skipped for 1 s, then retried)", "s")
    remote_write: str = config_key("through", "`through`: every new block (a vLLM chunk, an SGLang page) is also "
                                              "written to Redis at once (other hosts see it early); `evict`: only "
                                              "blocks evicted from the tier above")
    remote_workers: int = config_key(4, "threads of the mover into the remote tier (per TP rank under vLLM)", "threads")

    def check_remote_keys(self) -> None:
        """ConfigError naming a bad ``remote_*`` key (``remote_url`` and the timeouts too, when set)."""
        if not isinstance(self.remote_write, str) or self.remote_write not in REMOTE_WRITES:
            raise ConfigError(f"remote_write: unknown value {self.remote_write!r}; valid: {sorted(REMOTE_WRITES)}")
        w = self.remote_workers
        if not isinstance(w, int) or isinstance(w, bool) or not 1 <= w <= 64:
            raise ConfigError(f"remote_workers: expected an int in [1, 64], got {w!r}")
        self.remote_settings()

    def remote_settings(self) -> RemoteSettings | None:
        """The remote tier's settings (None without ``remote_url``); ConfigError names a bad ``remote_*`` key."""
        if self.remote_url is None:
            return None
        return RemoteSettings(self.remote_url, self.remote_password_env, self.remote_user, self.remote_tls_ca,
                              self.remote_connect_timeout_s, self.remote_timeout_s)
