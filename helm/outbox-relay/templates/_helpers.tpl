{{/*
Expand the name of the chart.
*/}}
{{- define "outbox-relay.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Create a default fully qualified app name.
We truncate at 63 chars because some Kubernetes name fields are limited to this (by the DNS naming spec).
If release name contains chart name it will be used as a full name.
*/}}
{{- define "outbox-relay.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Create chart name and version as used by the chart label.
*/}}
{{- define "outbox-relay.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Common labels
*/}}
{{- define "outbox-relay.labels" -}}
helm.sh/chart: {{ include "outbox-relay.chart" . }}
{{ include "outbox-relay.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: outbox-relay
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Selector labels (shared by relay and sweeper pods: the metrics Service selects both).
*/}}
{{- define "outbox-relay.selectorLabels" -}}
app.kubernetes.io/name: {{ include "outbox-relay.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Selector labels of one component. Call with (dict "ctx" $ "component" "relay").
*/}}
{{- define "outbox-relay.componentSelectorLabels" -}}
{{ include "outbox-relay.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
Create the name of the service account to use
*/}}
{{- define "outbox-relay.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "outbox-relay.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Container image reference; the tag defaults to the chart's appVersion.
*/}}
{{- define "outbox-relay.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion | toString) }}
{{- end }}
{{- end }}

{{/*
Render a value as an environment-variable string. Helm reads every number in
values as float64, so 2592000 would print as "2.592e+06": integral floats are
printed as integers.
*/}}
{{- define "outbox-relay.envValue" -}}
{{- if kindIs "float64" . -}}
{{- if eq . (floor .) -}}{{ int64 . }}{{- else -}}{{ . }}{{- end -}}
{{- else -}}
{{- toString . -}}
{{- end -}}
{{- end }}

{{/*
librdkafka property name -> OUTBOX_KAFKA_* environment variable name, the inverse
of docs/DESIGN.md's mapping (`___`->`-`, `__`->`_`, `_`->`.`): `_` -> `__` first, then
`-` -> `___`, then `.` -> `_`, upper-cased.
  bootstrap.servers   -> OUTBOX_KAFKA_BOOTSTRAP_SERVERS
  sasl.oauthbearer.x_y-z -> OUTBOX_KAFKA_SASL_OAUTHBEARER_X__Y___Z
A property that cannot round-trip (upper case, other characters, a separator next
to another) fails the render.
*/}}
{{- define "outbox-relay.kafkaEnvName" -}}
{{- $p := toString . -}}
{{- if not (regexMatch "^[a-z0-9]+([._-][a-z0-9]+)*$" $p) -}}
{{- fail (printf "kafka.properties: %q is not a librdkafka property name (lower-case words joined by single '.', '_' or '-')" $p) -}}
{{- end -}}
{{- printf "OUTBOX_KAFKA_%s" ($p | replace "_" "__" | replace "-" "___" | replace "." "_" | upper) -}}
{{- end }}

{{/*
Environment variable name of each key of .Values.config (an unknown key fails
the render instead of being silently ignored).
*/}}
{{- define "outbox-relay.configEnvNames" -}}
table: OUTBOX_TABLE
batchSize: OUTBOX_BATCH_SIZE
batchBytes: OUTBOX_BATCH_BYTES
pollIntervalMs: OUTBOX_POLL_INTERVAL_MS
ordering: OUTBOX_ORDERING
maxAttempts: OUTBOX_MAX_ATTEMPTS
backoff.initialMs: OUTBOX_BACKOFF_INITIAL_MS
backoff.maxMs: OUTBOX_BACKOFF_MAX_MS
topicTemplate: OUTBOX_TOPIC_TEMPLATE
valueFormat: OUTBOX_VALUE_FORMAT
serialization: OUTBOX_SERIALIZATION
schemaRegistryUrl: OUTBOX_SCHEMA_REGISTRY_URL
schemaRegistryAutoRegister: OUTBOX_SCHEMA_REGISTRY_AUTO_REGISTER
envelopeFields: OUTBOX_ENVELOPE_FIELDS
producerName: OUTBOX_PRODUCER_NAME
logLevel: OUTBOX_LOG_LEVEL
logFormat: OUTBOX_LOG_FORMAT
lockTimeoutS: OUTBOX_LOCK_TIMEOUT_S
sweepIntervalS: OUTBOX_SWEEP_INTERVAL_S
retentionS: OUTBOX_RETENTION_S
retentionKeepLatest: OUTBOX_RETENTION_KEEP_LATEST
deleteBatch: OUTBOX_DELETE_BATCH
statementTimeoutMs: OUTBOX_STATEMENT_TIMEOUT_MS
dbLockTimeoutMs: OUTBOX_DB_LOCK_TIMEOUT_MS
{{- end }}

{{/*
Effective librdkafka properties of the relay's producer, or (with "reconcile"
true) of the reconcile CronJob's consumer: those implied by kafka.sasl and
kafka.tls, then kafka.properties (which win); for reconcile its own SASL user
and client.id, and reconcile.kafka.properties over the rest. Passwords are not
here: they come from Secrets (see outbox-relay.kafkaEnv).
Call with (dict "ctx" $ "reconcile" true|false).
*/}}
{{- define "outbox-relay.kafkaProperties" -}}
{{- $ := .ctx -}}
{{- $props := dict -}}
{{- $sasl := $.Values.kafka.sasl | default dict -}}
{{- $tls := $.Values.kafka.tls | default dict -}}
{{- $rk := $.Values.reconcile.kafka | default dict -}}
{{- if and $sasl.enabled $tls.enabled }}
{{- $_ := set $props "security.protocol" "SASL_SSL" -}}
{{- else if $sasl.enabled }}
{{- $_ := set $props "security.protocol" "SASL_PLAINTEXT" -}}
{{- else if $tls.enabled }}
{{- $_ := set $props "security.protocol" "SSL" -}}
{{- end }}
{{- if $sasl.enabled }}
{{- $_ := set $props "sasl.mechanisms" (required "kafka.sasl.mechanism is required when kafka.sasl.enabled" $sasl.mechanism) -}}
{{- if .reconcile }}
{{- $_ := set $props "sasl.username" (required "reconcile.kafka.sasl.username is required when kafka.sasl.enabled: the reconcile CronJob reads the topics with a principal of its own (Read ACLs the relay's producer principal should not have)" ($rk.sasl | default dict).username) -}}
{{- else }}
{{- $_ := set $props "sasl.username" (required "kafka.sasl.username is required when kafka.sasl.enabled" $sasl.username) -}}
{{- end }}
{{- end }}
{{- if $tls.enabled }}
{{- $dir := $tls.mountPath | default "/etc/outbox-relay/kafka-tls" -}}
{{- if $tls.ca }}
{{- $_ := set $props "ssl.ca.location" (printf "%s/%s" $dir $tls.caKey) -}}
{{- end }}
{{- if $tls.clientCert }}
{{- $_ := set $props "ssl.certificate.location" (printf "%s/%s" $dir $tls.certKey) -}}
{{- $_ := set $props "ssl.key.location" (printf "%s/%s" $dir $tls.keyKey) -}}
{{- end }}
{{- end }}
{{- range $k, $v := $.Values.kafka.properties }}
{{- if not (kindIs "invalid" $v) }}
{{- $_ := set $props $k $v -}}
{{- end }}
{{- end }}
{{- if .reconcile }}
{{- $_ := set $props "client.id" ($rk.clientId | default (printf "%s-reconcile" (include "outbox-relay.fullname" $))) -}}
{{- range $k, $v := $rk.properties }}
{{- if not (kindIs "invalid" $v) }}
{{- $_ := set $props $k $v -}}
{{- end }}
{{- end }}
{{- end }}
{{- toYaml $props -}}
{{- end }}

{{/*
A librdkafka property of props under any of its names (librdkafka treats
aliases as one), with the name it was found under: (list name value), or an
empty list. Call with (dict "props" $props "names" (list "acks" "request.required.acks")).
*/}}
{{- define "outbox-relay.kafkaProp" -}}
{{- $found := list -}}
{{- range .names }}
{{- if hasKey $.props . }}{{ $found = list . (get $.props .) }}{{ end }}
{{- end }}
{{- toJson $found -}}
{{- end }}

{{/*
The relay's delivery timeout in ms: delivery.timeout.ms (or its alias
message.timeout.ms), librdkafka's default 120000 otherwise.
*/}}
{{- define "outbox-relay.deliveryTimeoutMs" -}}
{{- $dt := include "outbox-relay.kafkaProp" (dict "props" . "names" (list "message.timeout.ms" "delivery.timeout.ms")) | fromJsonArray -}}
{{- if $dt }}{{ int (index $dt 1) }}{{ else }}120000{{ end -}}
{{- end }}

{{/*
Producer settings the relay refuses at start (common/kafka.c, docs/DESIGN.md
"Configuration"): refused here too, when the chart renders, naming the value.
*/}}
{{- define "outbox-relay.checkGuarantees" -}}
{{- $props := . -}}
{{- $p := include "outbox-relay.kafkaProp" (dict "props" $props "names" (list "request.required.acks" "acks")) | fromJsonArray -}}
{{- if and $p (not (has (lower (toString (index $p 1))) (list "all" "-1"))) }}
{{- fail (printf "kafka.properties.%s=%v is refused: the relay needs acks=all (-1), or a broker may lose acknowledged events" (index $p 0) (index $p 1)) }}
{{- end }}
{{- $p = include "outbox-relay.kafkaProp" (dict "props" $props "names" (list "enable.idempotence")) | fromJsonArray -}}
{{- if and $p (not (has (lower (toString (index $p 1))) (list "true" "t" "1"))) }}
{{- fail (printf "kafka.properties.enable.idempotence=%v is refused: idempotence cannot be turned off (ordering and at-least-once depend on it)" (index $p 1)) }}
{{- end }}
{{- $p = include "outbox-relay.kafkaProp" (dict "props" $props "names" (list "max.in.flight" "max.in.flight.requests.per.connection")) | fromJsonArray -}}
{{- if and $p (gt (int (index $p 1)) 5) }}
{{- fail (printf "kafka.properties.%s=%v is refused: the idempotent producer keeps order with at most 5 requests in flight" (index $p 0) (index $p 1)) }}
{{- end }}
{{- $p = include "outbox-relay.kafkaProp" (dict "props" $props "names" (list "message.send.max.retries" "retries")) | fromJsonArray -}}
{{- if and $p (eq (toString (index $p 1)) "0") }}
{{- fail (printf "kafka.properties.%s=0 is refused: the idempotent producer needs retries" (index $p 0)) }}
{{- end }}
{{- $p = include "outbox-relay.kafkaProp" (dict "props" $props "names" (list "transactional.id")) | fromJsonArray -}}
{{- if and $p (ne (toString (index $p 1)) "") }}
{{- fail "kafka.properties.transactional.id is refused: the relay publishes with an idempotent, non-transactional producer" }}
{{- end }}
{{- $p = include "outbox-relay.kafkaProp" (dict "props" $props "names" (list "partitioner")) | fromJsonArray -}}
{{- if and $p (eq (toString (index $p 1)) "random") }}
{{- fail "kafka.properties.partitioner=random is refused: it spreads one aggregate over partitions and breaks per-aggregate order" }}
{{- end }}
{{- $p = include "outbox-relay.kafkaProp" (dict "props" $props "names" (list "queuing.strategy")) | fromJsonArray -}}
{{- if and $p (eq (toString (index $p 1)) "lifo") }}
{{- fail "kafka.properties.queuing.strategy=lifo is refused: it sends later messages first and breaks per-aggregate order" }}
{{- end }}
{{- end }}

{{/*
Bytes of a Kubernetes quantity (e.g. 256Mi, 1G, 268435456), as a float.
*/}}
{{- define "outbox-relay.quantityBytes" -}}
{{- $q := . -}}
{{- if or (kindIs "float64" $q) (kindIs "int" $q) (kindIs "int64" $q) -}}
{{- float64 $q -}}
{{- else -}}
{{- $q = toString $q -}}
{{- if not (regexMatch "^[0-9]+(\\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?$" $q) -}}
{{- fail (printf "relay.resources.limits.memory %q is not a quantity the chart reads (e.g. 256Mi, 1Gi, 268435456)" $q) -}}
{{- end -}}
{{- $n := float64 (regexFind "^[0-9]+(\\.[0-9]+)?" $q) -}}
{{- $unit := regexReplaceAll "^[0-9]+(\\.[0-9]+)?" $q "" -}}
{{- $mult := dict "" 1.0 "m" 0.001 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 -}}
{{- mulf $n (get $mult $unit) -}}
{{- end -}}
{{- end }}

{{/*
What a relay needs and the values that must leave room for it: the grace
period of a SIGTERM and the memory limit (formulas in values.yaml).
*/}}
{{- define "outbox-relay.checkRelayNeeds" -}}
{{- $ := .ctx -}}
{{- $props := .props -}}
{{- $dt := int (include "outbox-relay.deliveryTimeoutMs" $props) -}}
{{- $st := int ($.Values.config.statementTimeoutMs | default 10000) -}}
{{- $graceMs := add $dt 10000 (mul 2 $st) -}}
{{- $grace := div (add $graceMs 999) 1000 -}}
{{- $have := int $.Values.relay.terminationGracePeriodSeconds -}}
{{- if lt $have $grace }}
{{- fail (printf "relay.terminationGracePeriodSeconds %d is shorter than the %d s a relay needs to stop cleanly: delivery.timeout.ms %d + 10000 + 2 x config.statementTimeoutMs %d (values.yaml); a SIGKILL mid-batch leaves rows PUBLISHING until the sweeper takes them back" $have $grace $dt $st) }}
{{- end }}
{{- $limit := dig "limits" "memory" "" ($.Values.relay.resources | default dict) -}}
{{- if $limit }}
{{- $bb := float64 ($.Values.config.batchBytes | default 16777216) -}}
{{- $mmb := 1000000.0 -}}
{{- if hasKey $props "message.max.bytes" }}{{ $mmb = float64 (get $props "message.max.bytes") }}{{ end -}}
{{- $need := addf 20971520.0 (mulf 3.0 $bb) $mmb -}}
{{- $bytes := float64 (include "outbox-relay.quantityBytes" $limit) -}}
{{- if lt $bytes $need }}
{{- fail (printf "relay.resources.limits.memory %v is below the %d MiB a relay can need: 20 MiB + 3 x config.batchBytes %d + message.max.bytes %d (docs/operations.md, \"Memory\"); it would be OOM-killed mid-batch" $limit (int64 (ceil (divf $need 1048576.0))) (int64 $bb) (int64 $mmb)) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
env entries for Kafka settings. Call with (dict "ctx" $ "reconcile" true|false).
*/}}
{{- define "outbox-relay.kafkaEnv" -}}
{{- $ := .ctx -}}
{{- $props := include "outbox-relay.kafkaProperties" . | fromYaml -}}
{{- if not (get $props "bootstrap.servers") }}
{{- fail "kafka.properties.bootstrap.servers is required (the relay exits 2 without it)" }}
{{- end }}
{{- if not .reconcile }}
{{- include "outbox-relay.checkGuarantees" $props }}
{{- include "outbox-relay.checkRelayNeeds" (dict "ctx" $ "props" $props) }}
{{- /* The sweeper must not take back locks of batches still being delivered:
       its lock timeout outlasts the relay's delivery timeout by 30 s (the
       relay refuses the same at start). */ -}}
{{- $dt := int (include "outbox-relay.deliveryTimeoutMs" $props) -}}
{{- $lock := int ($.Values.config.lockTimeoutS | default 300) -}}
{{- if lt (mul $lock 1000) (add $dt 30000) }}
{{- fail (printf "config.lockTimeoutS %d s must outlast the relay's delivery.timeout.ms %d by 30 s (else the sweeper takes back rows still being delivered and they go out twice)" $lock $dt) }}
{{- end }}
{{- end }}
{{- range $k := keys $props | sortAlpha }}
- name: {{ include "outbox-relay.kafkaEnvName" $k }}
  value: {{ include "outbox-relay.envValue" (get $props $k) | quote }}
{{- end }}
{{- if $.Values.kafka.sasl.enabled }}
{{- if .reconcile }}
{{- $rs := $.Values.reconcile.kafka.sasl | default dict }}
- name: OUTBOX_KAFKA_SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ required "reconcile.kafka.sasl.existingSecret is required when kafka.sasl.enabled: the reconcile CronJob's own SASL password" $rs.existingSecret }}
      key: {{ $rs.passwordKey | default "password" }}
{{- else }}
- name: OUTBOX_KAFKA_SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ required "kafka.sasl.existingSecret is required when kafka.sasl.enabled" $.Values.kafka.sasl.existingSecret }}
      key: {{ $.Values.kafka.sasl.passwordKey | default "password" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
OUTBOX_DATABASE_URL from the release's database Secret, or from a workload's
own (reconcile.database, migrate.database) when that names one.
Call with (dict "ctx" $ "database" .Values.<workload>.database).
*/}}
{{- define "outbox-relay.databaseEnv" -}}
{{- $own := .database | default dict -}}
{{- $db := .ctx.Values.database -}}
- name: OUTBOX_DATABASE_URL
  valueFrom:
    secretKeyRef:
{{- if $own.existingSecret }}
      name: {{ $own.existingSecret }}
      key: {{ $own.secretKey | default "url" }}
{{- else }}
      name: {{ required "database.existingSecret is required: a Secret holding the libpq connection string" $db.existingSecret }}
      key: {{ $db.secretKey | default "url" }}
{{- end }}
{{- end }}

{{/*
env entries shared by both daemons: the database URL from the existing Secret.
*/}}
{{- define "outbox-relay.commonEnv" -}}
{{- include "outbox-relay.databaseEnv" (dict "ctx" . "database" dict) }}
{{- with .Values.schemaRegistry }}
{{- if .existingSecret }}
- name: OUTBOX_SCHEMA_REGISTRY_URL
  valueFrom:
    secretKeyRef:
      name: {{ .existingSecret }}
      key: {{ .secretKey | default "url" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Checksum of everything rendered from values into the pods' environment, so a
change rolls the pods.
*/}}
{{- define "outbox-relay.configChecksum" -}}
{{- $cm := include (print .Template.BasePath "/configmap.yaml") . -}}
{{- $kafka := include "outbox-relay.kafkaProperties" (dict "ctx" . "reconcile" false) -}}
{{- print $cm $kafka (toYaml .Values.kafka.sasl) (toYaml .Values.kafka.tls) (toYaml .Values.extraEnv) | sha256sum -}}
{{- end }}

{{/*
Pod-level scheduling and security settings shared by every workload.
*/}}
{{- define "outbox-relay.podSpecCommon" -}}
serviceAccountName: {{ include "outbox-relay.serviceAccountName" . }}
automountServiceAccountToken: {{ .Values.serviceAccount.automountServiceAccountToken }}
{{- /* Service links would inject <SVC>_* variables; a Service named like
       outbox-kafka-... would turn into OUTBOX_KAFKA_* "librdkafka properties"
       and stop the relay with exit 2. */}}
enableServiceLinks: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- end }}

{{/*
Volumes shared by every workload (writable /tmp on a read-only root, Kafka TLS).
*/}}
{{- define "outbox-relay.volumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: 16Mi
{{- if and .relay .ctx.Values.kafka.tls.enabled }}
{{- $tls := .ctx.Values.kafka.tls }}
{{- $own := ((.ctx.Values.reconcile.kafka | default dict).tls | default dict).existingSecret }}
- name: kafka-tls
  secret:
{{- if and .reconcile $tls.clientCert }}
    {{- /* a client certificate is an identity: the reconcile consumer's own */}}
    secretName: {{ required "reconcile.kafka.tls.existingSecret is required with kafka.tls.clientCert: the reconcile CronJob's own client certificate (same keys as kafka.tls)" $own }}
{{- else if and .reconcile $own }}
    secretName: {{ $own }}
{{- else }}
    secretName: {{ required "kafka.tls.existingSecret is required when kafka.tls.enabled" $tls.existingSecret }}
{{- end }}
    defaultMode: 0440
{{- end }}
{{- with .ctx.Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "outbox-relay.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if and .relay .ctx.Values.kafka.tls.enabled }}
- name: kafka-tls
  mountPath: {{ .ctx.Values.kafka.tls.mountPath | default "/etc/outbox-relay/kafka-tls" }}
  readOnly: true
{{- end }}
{{- with .ctx.Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
PromQL label matchers that select this release's series in the alert rules.
*/}}
{{- define "outbox-relay.alertSelector" -}}
{{- if .Values.prometheusRule.seriesSelector -}}
{{- .Values.prometheusRule.seriesSelector -}}
{{- else -}}
{{- printf "namespace=%q,service=%q" .Release.Namespace (include "outbox-relay.fullname" .) -}}
{{- end -}}
{{- end }}

{{/*
Extra labels of every alert (indented for files/alerts.yaml).
*/}}
{{- define "outbox-relay.alertExtraLabels" -}}
{{- with .Values.prometheusRule.additionalLabels }}
{{- toYaml . | nindent 10 }}
{{- end }}
{{- end }}

{{/*
topologySpreadConstraints with each entry's labelSelector defaulting to the
component's pods. Call with (dict "ctx" $ "component" "relay" "constraints" list).
*/}}
{{- define "outbox-relay.spreadConstraints" -}}
{{- $out := list -}}
{{- range .constraints }}
{{- $c := deepCopy . -}}
{{- if not (hasKey $c "labelSelector") }}
{{- $_ := set $c "labelSelector" (dict "matchLabels" (include "outbox-relay.componentSelectorLabels" (dict "ctx" $.ctx "component" $.component) | fromYaml)) -}}
{{- end }}
{{- $out = append $out $c -}}
{{- end }}
{{- toYaml $out -}}
{{- end }}
