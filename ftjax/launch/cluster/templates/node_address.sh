# the address Slurm reaches a node at (its NodeAddr; the node's name when they are the same)
node_address() {
  local addr
  addr=$(sinfo -h -N -n "$1" -o %o 2>/dev/null | head -n 1)
  addr=${addr:-$1}
  case $addr in *:*) echo "[$addr]" ;; *) echo "$addr" ;; esac
}
