-- Argo CD health check for diffstage.io/DiffusionStage (research/k8s_operator_anchors.md §5.8).
-- Install it as `resource.customizations.health.diffstage.io_DiffusionStage` in argocd-cm (argocd-cm.yaml here).
-- Order matters: a status the operator wrote for an older generation never counts as Healthy.
local hs = {}

local function condition(kind)
  if obj.status ~= nil and obj.status.conditions ~= nil then
    for _, c in ipairs(obj.status.conditions) do
      if c.type == kind then
        return c
      end
    end
  end
  return nil
end

local function is(kind, value)
  local c = condition(kind)
  return c ~= nil and c.status == value
end

local function describe(c)
  if c.message ~= nil and c.message ~= "" then
    return c.reason .. ": " .. c.message
  end
  return c.reason
end

local spec = obj.spec or {}
local status = obj.status
local desired = spec.replicas or 1
local autoscaling = (spec.autoscaling or {}).mode or "None"

-- 1. Being deleted: the pods drain first (phase Terminating, Progressing=True Draining names them). Argo CD
--    itself shows a resource with a deletionTimestamp as Progressing before it asks a health script.
if obj.metadata.deletionTimestamp ~= nil then
  local c = condition("Progressing")
  hs.status = "Progressing"
  if status ~= nil and status.phase == "Terminating" and c ~= nil then
    hs.message = describe(c)
  else
    hs.message = "being deleted"
  end
  return hs
end

-- 2. Nothing reported yet.
if status == nil or status.observedGeneration == nil then
  hs.status = "Progressing"
  hs.message = "waiting for the operator to observe the stage"
  return hs
end

-- 3. A spec change the operator has not seen yet (right after a sync).
if obj.metadata.generation ~= nil and obj.metadata.generation > status.observedGeneration then
  hs.status = "Progressing"
  hs.message = "spec change not yet observed (generation " .. obj.metadata.generation ..
    ", observed " .. status.observedGeneration .. ")"
  return hs
end

-- 4. Permanent trouble: the operator stopped trying, or refuses the spec.
if is("Stalled", "True") then
  hs.status = "Degraded"
  hs.message = describe(condition("Stalled"))
  return hs
end
if is("Accepted", "False") then
  hs.status = "Degraded"
  hs.message = describe(condition("Accepted"))
  return hs
end

-- 5. Suspended: scaled to zero by hand (no autoscaler will bring it back), nothing serves, on purpose.
--    (v1alpha1 has no spec.suspend; replicas: 0 is how a stage is paused.)
if desired == 0 and autoscaling == "None" and (status.replicas or 0) == 0 then
  hs.status = "Suspended"
  hs.message = "scaled to zero (spec.replicas: 0)"
  return hs
end

-- 6. A failed replica: Degraded when nothing serves (or Available=False, when reported), else a transient
--    restart that should not page anyone. A rolled-back rollout is Degraded even while the old revision
--    serves: the spec in Git is not what runs.
local ready = status.readyReplicas or 0
if is("Degraded", "True") then
  if ready == 0 or is("Available", "False") or condition("Degraded").reason == "RolloutFailed" then
    hs.status = "Degraded"
  else
    hs.status = "Progressing"
  end
  hs.message = describe(condition("Degraded")) .. " (" .. ready .. "/" .. desired .. " replicas ready)"
  return hs
end

-- 7. A rollout or scale in flight.
if is("Progressing", "True") or (status.updatedReplicas or 0) < desired then
  local c = condition("Progressing")
  hs.status = "Progressing"
  if c ~= nil and c.status == "True" then
    hs.message = describe(c)
  else
    hs.message = (status.updatedReplicas or 0) .. "/" .. desired .. " replicas updated"
  end
  return hs
end

-- 8. Serving.
if is("Ready", "True") and ready == desired then
  hs.status = "Healthy"
  if desired == 0 then
    hs.message = "scaled to zero by the autoscaler"
  else
    local world = (status.topology or {}).worldSize or "?"
    hs.message = ready .. "/" .. desired .. " replicas ready, world size " .. world
  end
  return hs
end

-- 9. Anything else: still getting there (never Unknown for a stage that exists).
local c = condition("Ready")
hs.status = "Progressing"
hs.message = c and describe(c) or "waiting for replicas"
return hs
