place() { ON=(${TPL_ALL_HOSTS}); LIVE=${TPL_HOSTS}; }
lost_host() { :; }
watch_step() {  # watch_step PID: until the step ends
  while kill -0 "$1" 2>/dev/null; do sleep 1; done
}
