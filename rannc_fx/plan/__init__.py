"""7. The plan and its types: the one serializable object between the compiler and the runtime
(stages, values, the device, the Config).

The modules are imported by name (``rannc_fx.plan.plan``, ``rannc_fx.plan.config``); this
package re-exports nothing, so that importing the Config does not import the plan."""
