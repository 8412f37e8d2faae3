#!/usr/bin/env bash
# Write server.properties from KAFKA_* variables (as the official image reads them), format the log dir
# with CLUSTER_ID unless it is formatted already, then exec the broker.
set -euo pipefail
props=/opt/kafka/config/server.properties
: > "$props"
while IFS='=' read -r name value; do
    case "$name" in
        KAFKA_HEAP_OPTS|KAFKA_OPTS|KAFKA_JVM_PERFORMANCE_OPTS) continue ;;
        KAFKA_*) ;;
        *) continue ;;
    esac
    key=${name#KAFKA_}
    key=$(printf '%s' "$key" | sed -e 's/__/\x01/g' -e 's/_/./g' -e 's/\x01/_/g' | tr '[:upper:]' '[:lower:]')
    printf '%s=%s\n' "$key" "$value" >> "$props"
done < <(env)
: "${CLUSTER_ID:?set CLUSTER_ID (a 22-character base64url Kafka Uuid)}"
cp="/opt/kafka/libs/*"
log_dirs=$(sed -n 's/^log.dirs=//p' "$props")
log_dirs=${log_dirs:-/var/lib/kafka/data}
grep -q '^log.dirs=' "$props" || echo "log.dirs=$log_dirs" >> "$props"
java_opts=(${KAFKA_HEAP_OPTS:--Xms256m -Xmx512m} ${KAFKA_OPTS:-} -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties)
if [[ ! -f "${log_dirs%%,*}/meta.properties" ]]; then
    java -Xmx256m -cp "$cp" -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties \
        kafka.tools.StorageTool format --config "$props" --cluster-id "$CLUSTER_ID" --ignore-formatted
fi
exec java "${java_opts[@]}" -cp "$cp" kafka.Kafka "$props"
