;; Imports `tick` with another type than host_loop.wat does (a string, not a u32):
;; `measure(s)` returns what `tick(s)` answers.
(component
  (import "tick" (func $tick (param "x" string) (result u32)))
  (core module $Memory
    (memory (export "mem") 1)
    (global $top (mut i32) (i32.const 1024))
    (func (export "realloc") (param i32 i32 i32 i32) (result i32)
      (local $p i32)
      (local.set $p (global.get $top))
      (global.set $top (i32.add (local.get $p) (local.get 3)))
      (local.get $p)))
  (core instance $memory (instantiate $Memory))
  (alias core export $memory "mem" (core memory $mem))
  (alias core export $memory "realloc" (core func $realloc))
  (core func $tick' (canon lower (func $tick) (memory $mem)))
  (core module $M
    (import "host" "tick" (func $tick (param i32 i32) (result i32)))
    (func (export "measure") (param i32 i32) (result i32)
      (call $tick (local.get 0) (local.get 1))))
  (core instance $m (instantiate $M (with "host" (instance (export "tick" (func $tick'))))))
  (func (export "measure") (param "s" string) (result u32)
    (canon lift (core func $m "measure") (memory $mem) (realloc $realloc)))
)
