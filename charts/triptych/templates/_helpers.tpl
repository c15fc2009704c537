{{/* Names and labels shared by the templates. */}}

{{- define "triptych.fullname" -}}
{{- if contains "triptych" .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-triptych" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "triptych.operatorName" -}}
{{- printf "%s-operator" (include "triptych.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "triptych.serviceAccountName" -}}
{{- default (include "triptych.operatorName" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "triptych.labels" -}}
app.kubernetes.io/part-of: triptych
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "triptych.operatorSelector" -}}
app.kubernetes.io/name: triptych-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Namespaces the operator watches (namespaced scope) — validated to be non-empty. */}}
{{- define "triptych.watchNamespaces" -}}
{{- if and (eq .Values.rbac.scope "namespaced") (empty .Values.rbac.watchNamespaces) -}}
{{- fail "rbac.scope=namespaced needs rbac.watchNamespaces (a list of namespaces)" -}}
{{- end -}}
{{- toJson .Values.rbac.watchNamespaces -}}
{{- end -}}

{{/*
The operator's permissions: exactly deploy/operator-rbac.yaml's rules (derived by
tests/operator/test_op_rbac.py from what the operator's code requests), plus kopf peering
when enabled. tests/install/test_chart.py keeps the two in step.
*/}}
{{- define "triptych.operatorRules" -}}
- apiGroups: ["triptych.dev"]
  resources: ["mllmdeployments"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["triptych.dev"]
  resources: ["mllmdeployments/status"]
  verbs: ["patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["configmaps", "services", "serviceaccounts"]
  verbs: ["list", "create", "patch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["list", "create", "patch"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["list", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["list", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["list", "create", "patch", "delete"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["servicemonitors"]
  verbs: ["list", "create", "patch", "delete"]
{{- end -}}

{{- define "triptych.peeringRule" -}}
- apiGroups: ["kopf.dev"]
  resources: [{{ . | quote }}]
  verbs: ["get", "list", "watch", "create", "patch"]
{{- end -}}
