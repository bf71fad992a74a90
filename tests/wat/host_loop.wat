;; `spin(n)` calls the host import `tick` n times, feeding each answer into the next call:
;; the per-call cost of a host function, measured from the guest's side.
(component
  (import "tick" (func $tick (param "x" u32) (result u32)))
  (core func $tick' (canon lower (func $tick)))
  (core module $M
    (import "host" "tick" (func $tick (param i32) (result i32)))
    (func (export "spin") (param $n i32) (result i32)
      (local $acc i32)
      (block $done
        (loop $next
          (br_if $done (i32.eqz (local.get $n)))
          (local.set $acc (call $tick (local.get $acc)))
          (local.set $n (i32.sub (local.get $n) (i32.const 1)))
          (br $next)))
      (local.get $acc)))
  (core instance $m (instantiate $M (with "host" (instance (export "tick" (func $tick'))))))
  (func (export "spin") (param "n" u32) (result u32)
    (canon lift (core func $m "spin")))
)
