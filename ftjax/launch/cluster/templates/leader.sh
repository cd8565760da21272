# process 0 (host 0 of a whole replica: the first node, where this script runs) serves the
# replica's jax.distributed cluster, on a port free here
FTJAX_PY=$(sed -n '1s/^#! *//p' "$(command -v ftjax)" 2>/dev/null || true)
FTJAX_PY=${FTJAX_PY%% *}
free_port() {
  "${FTJAX_PY:-python3}" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])' \
    2>/dev/null || echo $((20000 + RANDOM % 20000))
}
