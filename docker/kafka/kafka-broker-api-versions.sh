#!/usr/bin/env bash
# Same use as the official image's script: asks the broker for its API versions (kafka-tools' command).
exec java ${KAFKA_HEAP_OPTS:--Xmx128m} -cp "/opt/kafka/libs/*" -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties \
    org.apache.kafka.tools.BrokerApiVersionsCommand "$@"
