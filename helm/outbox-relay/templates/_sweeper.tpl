{{/*
The sweeper's pod spec, shared by its Deployment and its CronJob.
Call with (dict "ctx" $ "once" true|false).
*/}}
{{- define "outbox-relay.sweeperPodSpec" -}}
{{- $ := .ctx -}}
{{- include "outbox-relay.podSpecCommon" $ }}
terminationGracePeriodSeconds: {{ $.Values.sweeper.terminationGracePeriodSeconds }}
{{- if .once }}
restartPolicy: Never
{{- end }}
containers:
  - name: sweeper
    image: {{ include "outbox-relay.image" $ | quote }}
    imagePullPolicy: {{ $.Values.image.pullPolicy }}
    command: ["outbox-sweeper"]
    {{- if .once }}
    args: ["--once"]
    {{- end }}
    envFrom:
      - configMapRef:
          name: {{ include "outbox-relay.fullname" $ }}
    env:
      {{- include "outbox-relay.commonEnv" $ | trim | nindent 6 }}
      {{- if .once }}
      # A one-shot sweep is never scraped: no HTTP server (env wins over envFrom).
      - name: OUTBOX_HTTP_ADDR
        value: "off"
      {{- end }}
      {{- with $.Values.extraEnv }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    {{- if not .once }}
    ports:
      - name: http
        containerPort: {{ $.Values.http.port }}
        protocol: TCP
    {{- with $.Values.livenessProbe }}
    livenessProbe:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with $.Values.readinessProbe }}
    readinessProbe:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- end }}
    {{- with $.Values.securityContext }}
    securityContext:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with $.Values.sweeper.resources }}
    resources:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    volumeMounts:
      {{- include "outbox-relay.volumeMounts" (dict "ctx" $ "relay" false) | nindent 6 }}
volumes:
  {{- include "outbox-relay.volumes" (dict "ctx" $ "relay" false) | nindent 2 }}
{{- with $.Values.sweeper.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $.Values.sweeper.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $.Values.sweeper.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "outbox-relay.sweeperPodMeta" -}}
annotations:
  checksum/config: {{ include "outbox-relay.configChecksum" . }}
  {{- with .Values.sweeper.podAnnotations }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
labels:
  {{- include "outbox-relay.labels" . | nindent 2 }}
  app.kubernetes.io/component: sweeper
  {{- with .Values.sweeper.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}
