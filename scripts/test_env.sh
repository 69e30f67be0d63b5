# Sourced by the test command and bench/gpu_check.sh: servers on their own ports and
# folder, so a running development stack is left alone. Set whatever the shell exports:
# a development stack's TANDOOR_HOME or ports kept here made its servers the tests' (found
# running, taken as started), and the test command's teardown stopped them.
export PATH="$PWD/.venv/bin:$PATH"
export TANDOOR_ENV=test
export TANDOOR_HOME="$PWD/.tandoor/test"
export TANDOOR_KAFKA_PORT=19092
export TANDOOR_KAFKA_CONTROLLER_PORT=19093
export TANDOOR_CASSANDRA_PORT=19042
export TANDOOR_CASSANDRA_STORAGE_PORT=17000
export TANDOOR_REDIS_PORT=16379
