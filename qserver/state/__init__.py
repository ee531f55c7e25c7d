"""state"""
