{{/* The release's base name (63-character DNS label, less room for suffixes). */}}
{{- define "tandem.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tandem.labels" -}}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "tandem.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* --etcd: the external endpoints, or the bundled etcd's client Service. */}}
{{- define "tandem.etcdEndpoints" -}}
{{- if .Values.etcd.external.endpoints -}}
{{ join "," .Values.etcd.external.endpoints }}
{{- else -}}
http://{{ include "tandem.fullname" . }}-etcd:2379
{{- end -}}
{{- end -}}

{{- define "tandem.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "tandem.containerSecurityContext" -}}
allowPrivilegeEscalation: false
capabilities:
  drop: [ALL]
{{- end -}}

{{/* Environment every tandem container gets. */}}
{{- define "tandem.env" -}}
- name: TANDEM_LOG
  value: {{ .Values.logLevel | quote }}
{{- if .Values.logJson }}
- name: TANDEM_LOG_FORMAT
  value: json
{{- end }}
- name: TANDEM_CACHE_DIR
  value: {{ .Values.model.mountPath | quote }}
{{- end -}}

{{/* --kv-connector from .Values.kv. */}}
{{- define "tandem.kvConnector" -}}
{{- $kv := .Values.kv -}}
{{- if eq $kv.connector "tcp" -}}
tcp://0.0.0.0:{{ $kv.port }}
{{- else if eq $kv.connector "nccl" -}}
nccl://0.0.0.0:{{ $kv.port }}
{{- else if eq $kv.connector "plugin" -}}
{{- if not $kv.plugin.path }}{{ fail "kv.connector plugin needs kv.plugin.path" }}{{ end -}}
plugin:{{ $kv.plugin.path }}{{ if $kv.plugin.config }}?{{ $kv.plugin.config }}{{ end }}
{{- else -}}
{{ $kv.connector }}
{{- end -}}
{{- end -}}

{{/* terminationGracePeriodSeconds: the preStop sleep, the drain, and 10 s to exit. */}}
{{- define "tandem.gracePeriod" -}}
{{ add .preStopSleepSeconds .drainTimeoutSeconds 10 }}
{{- end -}}

{{- define "tandem.preStop" -}}
{{- if gt (int .preStopSleepSeconds) 0 }}
lifecycle:
  preStop:
    exec:
      command: ["sleep", "{{ .preStopSleepSeconds }}"]
{{- end }}
{{- end -}}

{{/* --tls-cert/--tls-key/--tls-ca from .Values.tls (args lines), when enabled. */}}
{{- define "tandem.tlsArgs" -}}
{{- if .Values.tls.enabled }}
{{- if not .Values.tls.secretName }}{{ fail "tls.enabled needs tls.secretName (a Secret with tls.crt, tls.key and ca.crt)" }}{{ end }}
- --tls-cert={{ .Values.tls.mountPath }}/tls.crt
- --tls-key={{ .Values.tls.mountPath }}/tls.key
- --tls-ca={{ .Values.tls.mountPath }}/ca.crt
{{- end }}
{{- end -}}

{{/* The TLS Secret's volumeMounts entry, when enabled. */}}
{{- define "tandem.tlsMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* The TLS Secret's volumes entry, when enabled. */}}
{{- define "tandem.tlsVolume" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- end -}}
