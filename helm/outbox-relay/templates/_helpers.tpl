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
{{- end }}

{{/*
Effective librdkafka properties: those implied by kafka.sasl and kafka.tls, then
kafka.properties (which win). The SASL password is not here: it comes from a
Secret (see outbox-relay.kafkaEnv).
*/}}
{{- define "outbox-relay.kafkaProperties" -}}
{{- $props := dict -}}
{{- $sasl := .Values.kafka.sasl | default dict -}}
{{- $tls := .Values.kafka.tls | default dict -}}
{{- if and $sasl.enabled $tls.enabled }}
{{- $_ := set $props "security.protocol" "SASL_SSL" -}}
{{- else if $sasl.enabled }}
{{- $_ := set $props "security.protocol" "SASL_PLAINTEXT" -}}
{{- else if $tls.enabled }}
{{- $_ := set $props "security.protocol" "SSL" -}}
{{- end }}
{{- if $sasl.enabled }}
{{- $_ := set $props "sasl.mechanisms" (required "kafka.sasl.mechanism is required when kafka.sasl.enabled" $sasl.mechanism) -}}
{{- $_ := set $props "sasl.username" (required "kafka.sasl.username is required when kafka.sasl.enabled" $sasl.username) -}}
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
{{- range $k, $v := .Values.kafka.properties }}
{{- if not (kindIs "invalid" $v) }}
{{- $_ := set $props $k $v -}}
{{- end }}
{{- end }}
{{- toYaml $props -}}
{{- end }}

{{/*
env entries for the relay's Kafka settings.
*/}}
{{- define "outbox-relay.kafkaEnv" -}}
{{- $props := include "outbox-relay.kafkaProperties" . | fromYaml -}}
{{- if not (get $props "bootstrap.servers") }}
{{- fail "kafka.properties.bootstrap.servers is required (the relay exits 2 without it)" }}
{{- end }}
{{- /* The sweeper must not take back locks of batches still being delivered:
       its lock timeout outlasts the relay's delivery timeout by 30 s (the
       relay refuses the same at start). */ -}}
{{- $dt := 120000 -}}
{{- if hasKey $props "message.timeout.ms" }}{{ $dt = int (get $props "message.timeout.ms") }}{{ end -}}
{{- if hasKey $props "delivery.timeout.ms" }}{{ $dt = int (get $props "delivery.timeout.ms") }}{{ end -}}
{{- $lock := int (.Values.config.lockTimeoutS | default 300) -}}
{{- if lt (mul $lock 1000) (add $dt 30000) }}
{{- fail (printf "config.lockTimeoutS %d s must outlast the relay's delivery.timeout.ms %d by 30 s (else the sweeper takes back rows still being delivered and they go out twice)" $lock $dt) }}
{{- end }}
{{- range $k := keys $props | sortAlpha }}
- name: {{ include "outbox-relay.kafkaEnvName" $k }}
  value: {{ include "outbox-relay.envValue" (get $props $k) | quote }}
{{- end }}
{{- if .Values.kafka.sasl.enabled }}
- name: OUTBOX_KAFKA_SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ required "kafka.sasl.existingSecret is required when kafka.sasl.enabled" .Values.kafka.sasl.existingSecret }}
      key: {{ .Values.kafka.sasl.passwordKey | default "password" }}
{{- end }}
{{- end }}

{{/*
env entries shared by both daemons: the database URL from the existing Secret.
*/}}
{{- define "outbox-relay.commonEnv" -}}
- name: OUTBOX_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ required "database.existingSecret is required: a Secret holding the libpq connection string" .Values.database.existingSecret }}
      key: {{ .Values.database.secretKey | default "url" }}
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
{{- $kafka := include "outbox-relay.kafkaProperties" . -}}
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
- name: kafka-tls
  secret:
    secretName: {{ required "kafka.tls.existingSecret is required when kafka.tls.enabled" .ctx.Values.kafka.tls.existingSecret }}
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
