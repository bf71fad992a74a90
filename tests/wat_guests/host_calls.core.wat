;; A guest for fast tests of the inferlet host. The first byte of the input picks a behaviour:
;; o: return ok("fine")   e: return ok(input)   t: trap   l: loop forever
;; c: create two contexts, then trap   p: wait on session.receive, then return ok("fine")
;; anything else: return err(input)
;; Rebuild host_calls.wat with tests/wat_guests/build.sh after editing.
(module
  (import "pie:inferlet/context@0.1.0" "create" (func $context_create (param i32 i32)))
  (import "pie:inferlet/session@0.1.0" "receive" (func $session_receive (result i32)))
  (import "pie:inferlet/futures@0.1.0" "poll" (func $futures_poll (param i32 i32 i32)))
  (memory (export "memory") 2)
  (global $heap (mut i32) (i32.const 4096))
  (data (i32.const 16) "fine")

  (func (export "cabi_realloc") (param i32 i32 i32 i32) (result i32)
    (local $p i32)
    (local.set $p
      (i32.and
        (i32.add (global.get $heap) (i32.sub (local.get 2) (i32.const 1)))
        (i32.sub (i32.const 0) (local.get 2))))
    (global.set $heap (i32.add (local.get $p) (local.get 3)))
    (local.get $p))

  (func $answer (param $tag i32) (param $ptr i32) (param $len i32) (result i32)
    (i32.store8 (i32.const 32) (local.get $tag))
    (i32.store (i32.const 36) (local.get $ptr))
    (i32.store (i32.const 40) (local.get $len))
    (i32.const 32))

  (func (export "run") (param $ptr i32) (param $len i32) (result i32)
    (local $c i32)
    (if (i32.eqz (local.get $len)) (then (return (call $answer (i32.const 1) (i32.const 16) (i32.const 0)))))
    (local.set $c (i32.load8_u (local.get $ptr)))
    (if (i32.eq (local.get $c) (i32.const 111))
      (then (return (call $answer (i32.const 0) (i32.const 16) (i32.const 4)))))
    (if (i32.eq (local.get $c) (i32.const 101))
      (then (return (call $answer (i32.const 0) (local.get $ptr) (local.get $len)))))
    (if (i32.eq (local.get $c) (i32.const 116)) (then unreachable))
    (if (i32.eq (local.get $c) (i32.const 108)) (then (loop $forever (br $forever))))
    (if (i32.eq (local.get $c) (i32.const 99))
      (then
        (call $context_create (i32.const 1) (i32.const 64))
        (call $context_create (i32.const 1) (i32.const 64))
        unreachable))
    (if (i32.eq (local.get $c) (i32.const 112))
      (then
        (i32.store (i32.const 128) (call $session_receive))
        (call $futures_poll (i32.const 128) (i32.const 1) (i32.const 64))
        (return (call $answer (i32.const 0) (i32.const 16) (i32.const 4)))))
    (call $answer (i32.const 1) (local.get $ptr) (local.get $len)))
)
